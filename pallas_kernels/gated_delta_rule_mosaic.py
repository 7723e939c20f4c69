"""Mosaic GPU (Hopper+) gated delta rule: recurrent decode and chunked prefill; math as in gated_delta_rule.py.

Recurrent kernel (`recurrent_gated_delta_rule`), grid (N, Hv), one warpgroup per (row, value head):
- TMA copies q, k (key head h // r) [dk], v [dv] and the state S [dk, dv] of read_row (row 0 is the zero state,
  -1 reads it too) into SMEM; S is tiled and swizzled so it loads into registers in the WGMMA layout (dk along
  the 64-row tiles, dv along the columns). The decay e^g and beta are read as scalars.
- In float32 registers: S <- e^g S; delta = beta (v - S^T k) (a column reduction); S <- S + k delta^T;
  o = S^T q. S goes back through SMEM to write_row and capture_row (rows 0: no write) with TMA stores.
Shapes: dk % 64 == 0, dv % 32 == 0, both <= 256 (the real models: dk = dv = 128).

Chunked form (`chunk_gated_delta_rule`), FLA's split of the work:
1. Intra-chunk part, parallel over (group, value head), in XLA (batched matmuls, float32): G = cumsum(g),
   Gamma, T = (I + strict_lower(beta K K^T Gamma))^-1 (blockwise, as the reference), and the kernel's operands
   W = T diag(beta e^G) K, U = T diag(beta) V, Qg = diag(e^G) Q, A = (Q K^T) * Gamma (incl. the diagonal),
   Kd = diag(e^(G_last - G)) K, e^G_last, all laid out [N, Hv, C, d] so one TMA box is one (group, head) tile.
2. State kernel, grid (Hv, dv / 64), one warpgroup each, the only sequential part: the state slice S [dk, 64]
   stays in float32 registers (WGMMA layout) and walks all N groups in order. Per group the tiles are TMA-copied
   into SMEM, double-buffered (group n + 1's tiles land in the other slot, on its own barrier, while group n
   computes); a segment's first group (is_first) also loads its initial state from read_row on a
   second barrier, under a cond (the barriers' phases advance per wait, so a conditional copy-and-wait pair is
   fine). Then on the tensor cores (wgmma, bfloat16 operands, float32
   accumulation, as FLA's chunk kernels): V' = U - W S; O = Qg S + A V'; S <- e^G_last S + Kd^T V'.
   S and V' go to SMEM in bfloat16 as wgmma operands (the carried S stays float32); O and the end state (float32)
   go out with TMA stores: the state to write_row when is_last and to capture_row (rows 0: no write).
Shapes: C % 64 == 0 (the GPU prefill chunk is 64), dk % 64 == 0, dv % 64 == 0, all <= 256.
Pool hazard as in the Triton kernels: a row written in a call is not read later in the same call by another
segment.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import gated_delta_rule as gdr_ops
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc

F32 = jnp.float32


def _check_dims(dk, dv, what):
    if dk % 64 or dv % 32 or dk > 256 or dv > 256:          # WGMMA-layout tiles; a TMA box is <= 256 per dim
        raise ValueError(f"{what} Mosaic GPU kernel: dk must be a multiple of 64 and dv of 32, both <= 256, got "
                         f"dk={dk}, dv={dv}")


def _recurrent_body(rows_ref, q_ref, k_ref, v_ref, decay_ref, beta_ref, state_ref, o_ref,
                    q_smem, k_smem, v_smem, s_smem, o_smem, bar, *, ratio, lay):
    n, h = jax.lax.axis_index("n"), jax.lax.axis_index("h")
    hk = h // ratio
    read, write, capture = rows_ref[0, n], rows_ref[1, n], rows_ref[2, n]
    plgpu.copy_gmem_to_smem(q_ref.at[n, hk], q_smem, bar)
    plgpu.copy_gmem_to_smem(k_ref.at[n, hk], k_smem, bar)
    plgpu.copy_gmem_to_smem(v_ref.at[n, h], v_smem, bar)
    plgpu.copy_gmem_to_smem(state_ref.at[jnp.maximum(read, 0), h], s_smem, bar)
    plgpu.barrier_wait(bar)
    decay, beta = decay_ref[n, h], beta_ref[n, h]
    s = s_smem[...] * decay                                                        # [dk, dv] WGMMA layout
    k = mc.bcast_rows(lay.rows(k_smem[...]), s.shape)
    delta = beta * (lay.cols(v_smem[...]) - jnp.sum(s * k, axis=0))               # [dv]
    s = s + k * mc.bcast_cols(delta, s.shape)
    o = jnp.sum(s * mc.bcast_rows(lay.rows(q_smem[...]), s.shape), axis=0)
    s_smem[...] = s
    o_smem[...] = o
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[n, h])
    for row in (write, capture):
        @pl.when(row > 0)
        def _():
            plgpu.copy_smem_to_gmem(s_smem, state_ref.at[row, h])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def recurrent_gated_delta_rule(q, k, v, g, beta, state, read_row, write_row, capture_row, *, interpret=False):
    """q, k: [N, Hk, dk]; v: [N, Hv, dv]; g, beta: [N, Hv]; state: [R, Hv, dk, dv] f32; rows: [N].
    Returns (o [N, Hv, dv] float32, new state pool)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    _check_dims(dk, dv, "recurrent_gated_delta_rule")
    rows = jnp.stack([read_row, write_row, capture_row]).astype(jnp.int32)
    operands = (rows, q.astype(F32), k.astype(F32), v.astype(F32), jnp.exp(g.astype(F32)), beta.astype(F32), state)
    body = functools.partial(_recurrent_body, ratio=hv // hk, lay=mc.Layouts(interpret))
    scratch = (plgpu.SMEM((dk,), F32), plgpu.SMEM((dk,), F32), plgpu.SMEM((dv,), F32), mc.smem_tile((dk, dv), F32),
               plgpu.SMEM((dv,), F32), plgpu.Barrier(num_arrivals=4))
    ins, (o,) = mc.launch(body, operands, (jax.ShapeDtypeStruct((n, hv, dv), F32),), grid=(n, hv),
                          grid_names=("n", "h"), scratch=scratch, interpret=interpret,
                          name="recurrent_gated_delta_rule_mosaic")
    return o, ins[-1]


BLOCK_V = 64
BF16 = jnp.bfloat16


def _chunk_state_body(rows_ref, first_ref, last_ref, decay_ref, w_ref, qg_ref, a_ref, kd_ref, u_ref, state_ref,
                      o_ref, w_smem, qg_smem, a_smem, kd_smem, u_smem, s_smem, sb_smem, vn_smem, o_smem, bar,
                      state_bar, *, lay):
    h, vb = jax.lax.axis_index("h"), jax.lax.axis_index("v")
    cols = pl.ds(vb * BLOCK_V, BLOCK_V)
    num_groups = w_ref.shape[0]
    dk = w_ref.shape[3]

    def fetch(n, slot):
        for src, dst in ((w_ref.at[n, h], w_smem), (qg_ref.at[n, h], qg_smem), (a_ref.at[n, h], a_smem),
                         (kd_ref.at[n, h], kd_smem), (u_ref.at[n, h, :, cols], u_smem)):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])

    fetch(0, 0)

    def group(n, s):
        slot = n % 2

        @pl.when(n + 1 < num_groups)          # double buffer: group n + 1's tiles land while group n computes;
        def _():                                # the other slot's last reader (group n - 1) has finished
            fetch(n + 1, 1 - slot)

        def load_state():                       # a segment's first group: its initial state (row 0: zeros)
            plgpu.copy_gmem_to_smem(state_ref.at[jnp.maximum(rows_ref[0, n], 0), h, :, cols], s_smem, state_bar)
            plgpu.barrier_wait(state_bar)
            return s_smem[...]

        s = jax.lax.cond(first_ref[n] > 0, load_state, lambda: s)                      # [dk, BV] f32
        plgpu.barrier_wait(bar.at[slot])
        sb_smem[...] = s.astype(BF16)
        plgpu.commit_smem()
        v_new = u_smem[slot] - mc.matmul(w_smem.at[slot], sb_smem, lay=lay)             # V' = U - W S [C, BV]
        vn_smem[...] = v_new.astype(BF16)
        plgpu.commit_smem()
        o = (mc.matmul(qg_smem.at[slot], sb_smem, lay=lay)                              # Qg S + A V'
             + mc.matmul(a_smem.at[slot], vn_smem, lay=lay))
        s = decay_ref[n, h] * s + mc.matmul(kd_smem.at[slot], vn_smem, lay=lay, transpose_a=True)  # + Kd^T V'
        o_smem[...] = o
        s_smem[...] = s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[n, h, :, cols])
        for row, enabled in ((rows_ref[1, n], last_ref[n] > 0), (rows_ref[2, n], True)):
            @pl.when(enabled & (row > 0))
            def _():
                plgpu.copy_smem_to_gmem(s_smem, state_ref.at[row, h, :, cols])
        plgpu.wait_smem_to_gmem(0)              # o_smem and s_smem are rewritten by the next group
        return s

    jax.lax.fori_loop(0, num_groups, group, lay.tile(jnp.full((dk, BLOCK_V), 0.0, F32)))


def _intra_chunk(q, k, v, g, beta, length):
    """The parallel part (step 1 of the module docstring), float32: returns the state kernel's operands."""
    n, c, hk, dk = q.shape
    hv = v.shape[2]
    r = hv // hk
    valid = jnp.arange(c)[None, :] < length[:, None]                                   # [N, C]
    q, k = (jnp.swapaxes(jnp.where(valid[..., None, None], x.astype(F32), 0.0), 1, 2) for x in (q, k))
    kk, qk = (jnp.repeat(gdr_ops._mm_nt(x, k), r, axis=1) for x in (k, q))              # [N, Hv, C, C]
    q, k = jnp.repeat(q, r, axis=1), jnp.repeat(k, r, axis=1)                          # [N, Hv, C, dk]
    v = jnp.swapaxes(v.astype(F32), 1, 2)
    g = jnp.swapaxes(jnp.where(valid[..., None], g.astype(F32), 0.0), 1, 2)            # [N, Hv, C]
    beta = jnp.swapaxes(jnp.where(valid[..., None], beta.astype(F32), 0.0), 1, 2)
    big_g = jnp.cumsum(g, axis=-1)
    causal = jnp.tril(jnp.ones((c, c), bool))
    gamma = jnp.exp(jnp.where(causal, big_g[..., :, None] - big_g[..., None, :], -jnp.inf))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    t_mat = gdr_ops.unit_lower_inverse(jnp.where(strict, beta[..., :, None] * kk * gamma, 0.0))
    eg = jnp.exp(big_g)[..., None]
    g_last = big_g[..., -1]
    w = gdr_ops._mm(t_mat, (beta[..., None] * eg) * k)
    u = gdr_ops._mm(t_mat, beta[..., None] * v)
    kd = jnp.exp(g_last[..., None] - big_g)[..., None] * k
    return w, u, eg * q, qk * gamma, kd, jnp.exp(g_last)


@functools.partial(jax.jit, static_argnames=("interpret",))
def chunk_gated_delta_rule(q, k, v, g, beta, length, state, read_row, write_row, capture_row, is_first, is_last, *,
                           interpret=False):
    """q, k: [N, C, Hk, dk]; v: [N, C, Hv, dv]; g, beta: [N, C, Hv]; state: [R, Hv, dk, dv] f32; rows: [N].
    Returns (o [N, C, Hv, dv] float32, new state pool)."""
    n, c, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if c % 64 or c > 256 or dk % 64 or dv % BLOCK_V or dk > 256 or dv > 256:
        raise ValueError(f"chunk_gated_delta_rule Mosaic GPU kernel: C, dk and dv must be multiples of 64, <= 256, "
                         f"got C={c}, dk={dk}, dv={dv}")
    w, u, qg, a, kd, decay = _intra_chunk(q, k, v, g, beta, length)
    rows = jnp.stack([read_row, write_row, capture_row]).astype(jnp.int32)
    flags = [x.astype(jnp.int32) for x in (is_first, is_last)]
    operands = (rows, *flags, decay, w.astype(BF16), qg.astype(BF16), a.astype(BF16), kd.astype(BF16), u, state)
    # SMEM at C = 64, dk = 128: two slots of W, Qg, Kd (16 KiB each), A (8) and U (16) = 144 KiB,
    # S f32 (32, its initial value in and its end value out), S bf16 (16), V' (8), O (16): 216 KiB of H100's 227.
    slots = lambda shape, dtype: mc.smem_tile((2,) + shape, dtype)  # noqa: E731
    scratch = (slots((c, dk), BF16), slots((c, dk), BF16), slots((c, c), BF16), slots((c, dk), BF16),
               slots((c, BLOCK_V), F32), mc.smem_tile((dk, BLOCK_V), F32), mc.smem_tile((dk, BLOCK_V), BF16),
               mc.smem_tile((c, BLOCK_V), BF16), mc.smem_tile((c, BLOCK_V), F32),
               plgpu.Barrier(num_arrivals=5, num_barriers=2), plgpu.Barrier(num_arrivals=1))
    body = functools.partial(_chunk_state_body, lay=mc.Layouts(interpret))
    ins, (o,) = mc.launch(body, operands, (jax.ShapeDtypeStruct((n, hv, c, dv), F32),), grid=(hv, dv // BLOCK_V),
                          grid_names=("h", "v"), scratch=scratch, interpret=interpret,
                          name="chunk_gated_delta_rule_mosaic")
    valid = jnp.arange(c)[None, :, None, None] < length[:, None, None, None]
    return jnp.where(valid, jnp.swapaxes(o, 1, 2), 0.0), ins[-1]
