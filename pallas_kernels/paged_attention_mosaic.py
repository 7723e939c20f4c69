"""Mosaic GPU (Hopper+) ragged paged attention, decode and chunked prefill; math and masking as in
paged_attention.py.

Kernel design:
- Rows. Outside the kernel the queries of group n and kv head h become one row block [L * G, D] (row = l * G + g,
  G = Hq / Hkv, no power-of-two padding), padded to a multiple of 64 rows (the wgmma M tile). Each row carries its
  query position (padding: -1). Grid (N, Hkv, row blocks of 64): one warpgroup per block.
- Paging. The block table, kv_len and each block's visible end (min(kv_len, max q_pos + 1), computed outside)
  are GMEM inputs read as scalars. A loop step covers BK = max(64, block_size) keys: BK / block_size pages are
  TMA-copied (head-major pages: k[h, page] is one contiguous [block_size, D] box) into row slices of one tiled,
  128-byte-swizzled SMEM tile per K and V, on one barrier per slot. Two slots: the next step's pages are in
  flight while this step computes. SMEM at D = 256: Q 32 KiB + 2 x 2 x 32 KiB K/V slots (the output tile, 64 KiB,
  reuses the slots' space after the loop).
- Tensor cores. S = Q K^T and acc += P V are wgmma with float32 accumulators (Q, K, V in SMEM; P from registers
  in the page dtype). Online softmax in float32 registers (WGMMA layout; row max / sum are row reductions).
  Masked scores are dropped with `where` after the exp, so padding rows (q_pos < 0) keep l = 0 and return 0.
- KV splits (flash-decoding): when N * Hkv * row blocks is below 256 blocks (decode batches), the key steps are
  split over a 4th grid axis so the grid still fills the GPU; each split writes its unnormalised (acc, m, l) and
  XLA merges them by rescaling to the common max (also with one split: a small [rows, D] pass).
Shapes: pages bf16 or f16 (tf32 wgmma cannot take V's layout), D % 64 == 0 and D <= 256, block_size % 8 == 0 and
block_size <= 256. The query dtype is cast to the page dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc

F32 = jnp.float32
BLOCK_M = 64
_NEG = -1e30


def _num_splits(blocks, steps, min_blocks):
    """(splits, key steps per split) so that a small batch (decode) still fills the GPU: >= min_blocks blocks."""
    splits = min(max(1, -(-min_blocks // blocks)), max(steps, 1))
    per_split = -(-steps // splits)
    return -(-steps // per_split), per_split


def _check(cond, message):
    if not cond:
        raise ValueError(message)


def _body(bt_ref, kv_len_ref, end_ref, pos_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref,
          q_smem, pos_smem, m_smem, l_smem, q_bar, *, sm_scale, block_size, block_kv, steps_per_split, lay):
    n, h, r, split = (jax.lax.axis_index(a) for a in ("n", "h", "r", "s"))
    rows = pl.ds(r * BLOCK_M, BLOCK_M)
    pages_per_step = block_kv // block_size
    max_blocks, num_pages = bt_ref.shape[1], k_ref.shape[1]
    d = q_smem.shape[1]
    plgpu.copy_gmem_to_smem(q_ref.at[n, h, rows], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(pos_ref.at[n, rows], pos_smem, q_bar)
    kv_len, end = kv_len_ref[n], end_ref[n, r]
    first = split * steps_per_split
    last = jnp.maximum(first, jnp.minimum(first + steps_per_split, (end + block_kv - 1) // block_kv))

    def key_loop(k_smem, v_smem, kv_bar):
        """Double-buffered: step b's pages land in slot (b - first) % 2 while step b - 1 computes on the other."""
        def fetch(b, slot):
            for j in range(pages_per_step):
                page = bt_ref[n, jnp.minimum(b * pages_per_step + j, max_blocks - 1)]
                page = jnp.clip(page, 0, num_pages - 1)
                keys = pl.ds(j * block_size, block_size)
                plgpu.copy_gmem_to_smem(k_ref.at[h, page], k_smem.at[slot, keys], kv_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[h, page], v_smem.at[slot, keys], kv_bar.at[slot])

        @pl.when(first < last)
        def _():
            fetch(first, 0)

        plgpu.barrier_wait(q_bar)
        pos = mc.bcast_rows(lay.rows(pos_smem[...]), (BLOCK_M, block_kv))

        def step(b, carry):
            m, l, acc = carry
            slot = (b - first) % 2

            @pl.when(b + 1 < last)                 # the other slot's last reader (step b - 1) has finished
            def _():
                fetch(b + 1, 1 - slot)

            plgpu.barrier_wait(kv_bar.at[slot])
            s = mc.matmul(q_smem, k_smem.at[slot], lay=lay, transpose_b=True) * sm_scale         # Q K^T [64, BK]
            key = b * block_kv + lay.iota((BLOCK_M, block_kv), 1)
            visible = (key < kv_len) & (key <= pos)
            s = jnp.where(visible, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(visible, jnp.exp(s - mc.bcast_rows(m_new, s.shape)), 0.0)
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=1)
            # P V into a fresh (zeroed) accumulator, added in registers (run_state with ACC.init(acc) would
            # accumulate in place, but the interpreter has no run_state).
            pv = mc.matmul(p.astype(v_smem.dtype), v_smem.at[slot], lay=lay)
            return m_new, l, acc * mc.bcast_rows(corr, acc.shape) + pv

        init = (lay.rows(jnp.full((BLOCK_M,), _NEG, F32)), lay.rows(jnp.full((BLOCK_M,), 0.0, F32)),
                lay.tile(jnp.full((BLOCK_M, d), 0.0, F32)))
        return jax.lax.fori_loop(first, last, step, init)

    dtype = k_ref.dtype
    m, l, acc = pl.run_scoped(key_loop, mc.smem_tile((2, block_kv, d), dtype), mc.smem_tile((2, block_kv, d), dtype),
                              plgpu.Barrier(num_arrivals=2 * pages_per_step, num_barriers=2))

    def epilogue(acc_smem):                        # its SMEM reuses the K/V slots' (scopes are stack-allocated)
        acc_smem[...] = acc
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem, acc_ref.at[n, h, split, rows])
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[n, h, split, rows])
        plgpu.copy_smem_to_gmem(l_smem, l_ref.at[n, h, split, rows])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue, mc.smem_tile((BLOCK_M, d), F32))


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "min_blocks"))
def paged_attention(q, k_pages, v_pages, block_table, kv_len, q_pos, *, sm_scale, interpret=False, min_blocks=256):
    """q: [N, L, Hq, D]; pages: [Hkv, blocks, bs, D]; block_table: [N, MB]; kv_len: [N]; q_pos: [N, L].
    Returns [N, L, Hq, D] float32. min_blocks: the grid size KV splits aim for (1: no splits)."""
    n, length, hq, d = q.shape
    hkv, _, block_size, _ = k_pages.shape
    dtype = k_pages.dtype
    _check(dtype in (jnp.bfloat16, jnp.float16),
           f"paged_attention Mosaic GPU kernel: pages must be bfloat16 or float16, got {dtype}")
    _check(d % 64 == 0 and d <= 256, f"paged_attention Mosaic GPU kernel: head_dim must be a multiple of 64 and "
                                     f"<= 256, got {d}")
    _check(block_size % 8 == 0 and block_size <= 256 and (64 % block_size == 0 or block_size % 64 == 0),
           f"paged_attention Mosaic GPU kernel: block_size must divide 64 or be a multiple of 64 (<= 256), got "
           f"{block_size}")
    group = hq // hkv
    num_rows = length * group
    rows_p = -(-num_rows // BLOCK_M) * BLOCK_M
    row_blocks = rows_p // BLOCK_M
    # [N, L, Hkv, G, D] -> [N, Hkv, L * G (+pad), D]
    qr = q.reshape(n, length, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(n, hkv, num_rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_p - num_rows), (0, 0))).astype(dtype)
    pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), group, axis=1), ((0, 0), (0, rows_p - num_rows)),
                  constant_values=-1)
    kv_len = kv_len.astype(jnp.int32)
    end = jnp.minimum(kv_len[:, None], jnp.max(pos.reshape(n, row_blocks, BLOCK_M), axis=2) + 1)   # [N, blocks]
    block_kv = max(64, block_size)
    splits, steps_per_split = _num_splits(n * hkv * row_blocks, -(-block_table.shape[1] * block_size // block_kv),
                                          min_blocks)
    body = functools.partial(_body, sm_scale=float(sm_scale), block_size=block_size, block_kv=block_kv,
                             steps_per_split=steps_per_split, lay=mc.Layouts(interpret))
    scratch = (mc.smem_tile((BLOCK_M, d), dtype), plgpu.SMEM((BLOCK_M,), jnp.int32), plgpu.SMEM((BLOCK_M,), F32),
               plgpu.SMEM((BLOCK_M,), F32), plgpu.Barrier(num_arrivals=2))
    operands = (block_table.astype(jnp.int32), kv_len, end.astype(jnp.int32), pos, qr, k_pages, v_pages)
    outputs = (jax.ShapeDtypeStruct((n, hkv, splits, rows_p, d), F32),
               jax.ShapeDtypeStruct((n, hkv, splits, rows_p), F32), jax.ShapeDtypeStruct((n, hkv, splits, rows_p), F32))
    _, (acc, m, l) = mc.launch(body, operands, outputs, grid=(n, hkv, row_blocks, splits),
                               grid_names=("n", "h", "r", "s"), scratch=scratch, interpret=interpret,
                               name="paged_attention_mosaic")
    # Merge the KV splits: rescale each split's sums to the common max.
    scale = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))                         # [N, Hkv, S, rows]
    l = jnp.sum(scale * l, axis=2)
    acc = jnp.sum(scale[..., None] * acc, axis=2)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = out[:, :, :num_rows].reshape(n, hkv, length, group, d)
    return out.transpose(0, 2, 1, 3, 4).reshape(n, length, hq, d)
