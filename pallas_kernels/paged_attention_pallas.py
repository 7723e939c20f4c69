"""Pallas (Triton backend) ragged paged attention for NVIDIA GPUs; math and masking as in paged_attention.py.

Kernel design:
- Rows. Outside the kernel the queries of group n and kv head h are laid out as one row block
  [L_pad * G_pad, D] (row = l * G_pad + g; G = Hq / Hkv padded to a power of two, L padded to a power of two,
  at least 16 rows so the dots are legal). Each row carries its query position; padded rows get -1.
- Grid (N, Hkv, row blocks of BM <= 64, KV splits). A program holds q [BM, D] and the online-softmax state
  m [BM], l [BM], acc [BM, D] in float32, and walks its split's share of the group's pages with a fori_loop. The
  group's page count is cdiv(min(kv_len, max q_pos + 1), block_size): causal prefill blocks stop at their last
  visible page.
- KV splits (flash-decoding): when N * Hkv * row blocks is below 256 programs (decode batches), the page list is
  split so the grid still fills the GPU. Each split writes its unnormalised (acc, m, l); XLA merges them by
  rescaling to the common max. Prefill-sized calls get one split.
- Paging. The block table and kv_len are ordinary inputs indexed inside the kernel (Triton has no scalar
  prefetch); the head-major page pools [Hkv, blocks, bs, D] are one whole-array block and each step reads the
  contiguous tile k/v[h, page] [bs, D].
- Numerics. q k^T and p v are 2-D dots accumulating in float32 (ieee for f32 inputs; p is cast to the page dtype
  for the bf16 tensor-core path). Masked scores are dropped with `where` after the exp, so fully masked rows
  (padding, q_pos < 0) and empty splits keep l = 0; rows with l = 0 return 0.
- One page per loop step: block_size 16 gives [BM, 16] score tiles (fine for Triton's 16-wide dot minimum, but
  short loads); block_size 64 gives longer contiguous loads.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_NEG = -1e30


def _next_pow2(x):
    return 1 << max(0, (x - 1).bit_length())


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _dot(a, b, contract):
    """2-D dot with float32 accumulation; ieee precision when an operand is float32."""
    precision = jax.lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else None
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _kernel(bt_ref, kv_len_ref, pos_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, sm_scale, block_size,
            pages_per_split):
    n, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    q = q_ref[...]                                                                 # [BM, D]
    pos = pos_ref[...]                                                             # [BM]
    block_m, d = q.shape
    kv_len = kv_len_ref[n]
    end = jnp.minimum(kv_len, jnp.max(pos) + 1)
    num_pages = jnp.clip((end + block_size - 1) // block_size, 0, bt_ref.shape[1])
    first = split * pages_per_split
    last = jnp.minimum(first + pages_per_split, num_pages)

    def body(b, carry):
        m, l, acc = carry
        page = bt_ref[n, b]
        k = k_ref[h, page].astype(q.dtype)                                         # [bs, D]
        v = v_ref[h, page].astype(q.dtype)
        s = _dot(q, k, ((1,), (1,))) * sm_scale                                    # [BM, bs]
        key = b * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_size), 1)
        visible = (key < kv_len) & (key <= pos[:, None])
        s = jnp.where(visible, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v, ((1,), (0,)))
        return m_new, l, acc

    init = (jnp.full((block_m,), _NEG, jnp.float32), jnp.zeros((block_m,), jnp.float32),
            jnp.zeros((block_m, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, jnp.maximum(first, last), body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _num_splits(programs, max_blocks):
    """KV splits so that a small batch (decode) still fills the GPU: aim for >= 256 programs."""
    splits = min(max(1, -(-256 // programs)), max_blocks)
    pages_per_split = -(-max_blocks // splits)
    return -(-max_blocks // pages_per_split), pages_per_split


def _check(cond, message):
    if not cond:
        raise ValueError(message)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret"))
def paged_attention(q, k_pages, v_pages, block_table, kv_len, q_pos, *, sm_scale, interpret=False):
    """q: [N, L, Hq, D]; pages: [Hkv, blocks, bs, D]; block_table: [N, MB]; kv_len: [N]; q_pos: [N, L].
    Returns [N, L, Hq, D] float32."""
    n, length, hq, d = q.shape
    hkv, _, block_size, _ = k_pages.shape
    _check(d >= 16 and d == _next_pow2(d), f"paged_attention kernel: head_dim must be a power of two >= 16, got {d}")
    _check(block_size >= 16 and block_size == _next_pow2(block_size),
           f"paged_attention kernel: block_size must be a power of two >= 16, got {block_size}")
    group = hq // hkv
    group_p, length_p = _next_pow2(group), _next_pow2(length)
    num_rows = length_p * group_p
    block_m = min(max(num_rows, 16), 64)
    rows_p = max(num_rows, block_m)

    # [N, L, Hkv, G, D] -> [N, Hkv, L_pad * G_pad (+pad), D]
    qr = q.reshape(n, length, hkv, group, d)
    qr = jnp.pad(qr, ((0, 0), (0, length_p - length), (0, 0), (0, group_p - group), (0, 0)))
    qr = qr.transpose(0, 2, 1, 3, 4).reshape(n, hkv, num_rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_p - num_rows), (0, 0)))
    pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, length_p - length)), constant_values=-1)
    pos = jnp.pad(jnp.repeat(pos, group_p, axis=1), ((0, 0), (0, rows_p - num_rows)), constant_values=-1)
    if qr.dtype != k_pages.dtype and k_pages.dtype != jnp.float8_e4m3fn:
        qr = qr.astype(jnp.promote_types(qr.dtype, k_pages.dtype))
    # fp8 pages: each page is read as e4m3 (one byte a value) and widened to q's dtype in registers

    block_table = block_table.astype(jnp.int32)
    kv_len = kv_len.astype(jnp.int32)
    row_blocks = rows_p // block_m
    splits, pages_per_split = _num_splits(n * hkv * row_blocks, block_table.shape[1])
    kernel = functools.partial(_kernel, sm_scale=float(sm_scale), block_size=block_size,
                               pages_per_split=pages_per_split)
    f32 = jnp.float32
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n, hkv, splits, rows_p, d), f32),
                   jax.ShapeDtypeStruct((n, hkv, splits, rows_p), f32),
                   jax.ShapeDtypeStruct((n, hkv, splits, rows_p), f32)),
        grid=(n, hkv, row_blocks, splits),
        in_specs=[_whole(block_table.shape), _whole(kv_len.shape),
                  pl.BlockSpec((None, block_m), lambda i, h, r, s: (i, r)),
                  pl.BlockSpec((None, None, block_m, d), lambda i, h, r, s: (i, h, r, 0)),
                  _whole(k_pages.shape), _whole(v_pages.shape)],
        out_specs=(pl.BlockSpec((None, None, None, block_m, d), lambda i, h, r, s: (i, h, s, r, 0)),
                   pl.BlockSpec((None, None, None, block_m), lambda i, h, r, s: (i, h, s, r)),
                   pl.BlockSpec((None, None, None, block_m), lambda i, h, r, s: (i, h, s, r))),
        compiler_params=pltriton.CompilerParams(num_warps=4 if block_m * d <= 64 * 128 else 8, num_stages=2),
        interpret=interpret,
        name="paged_attention",
    )(block_table, kv_len, pos, qr, k_pages, v_pages)
    # Merge the KV splits (flash-decoding): rescale each split's sums to the common max.
    m_all = jnp.max(m, axis=2, keepdims=True)
    scale = jnp.exp(m - m_all)                                                     # [N, Hkv, S, rows]
    l = jnp.sum(scale * l, axis=2)
    acc = jnp.sum(scale[..., None] * acc, axis=2)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = out[:, :, :num_rows].reshape(n, hkv, length_p, group_p, d)[:, :, :length, :group]
    return out.transpose(0, 2, 1, 3, 4).reshape(n, length, hq, d)
