"""Mosaic GPU (Hopper+) gated delta rule: recurrent decode and chunked prefill; math as in gated_delta_rule.py.

Recurrent kernel (`recurrent_gated_delta_rule`), grid (N, Hv), one warpgroup per (row, value head):
- TMA copies q, k (key head h // r) [dk], v [dv] and the state S [dk, dv] of read_row (row 0 is the zero state,
  -1 reads it too) into SMEM; S is tiled and swizzled so it loads into registers in the WGMMA layout (dk along
  the 64-row tiles, dv along the columns). The decay e^g and beta are read as scalars.
- In float32 registers: S <- e^g S; delta = beta (v - S^T k) (a column reduction); S <- S + k delta^T;
  o = S^T q. S goes back through SMEM to write_row and capture_row (rows 0: no write) with TMA stores.
Shapes: dk % 64 == 0, dv % 32 == 0, both <= 256 (the real models: dk = dv = 128).

Chunked kernel (`chunk_gated_delta_rule`): see `_chunk_state_body`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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
