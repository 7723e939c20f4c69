"""Ragged paged attention over query groups, and the paged KV write.

Pages: k_pages, v_pages [Hkv, num_blocks, block_size, D] (head-major); token slot s lives at page s // block_size,
row s % block_size, of every head's pool. Block 0 is a dummy that padding tokens write into. Head-major pages let
a group's gathered keys of one head lie contiguous, so every dot below batches over (kv head, group) with no
transposes in the loop (XLA:CPU, small config: prefill 40 groups of 32 queries 84 -> 67 ms, decode 16 rows
6.2 -> 5.0 ms against [num_blocks, block_size, Hkv, D] pages).

Queries come as N groups of L rows [N, L, Hq, D]; a group is consecutive new tokens of ONE sequence (a decode
token: L = 1; a prefill chunk: L = C). Group n reads its sequence's pages through block_table[n] and sees key j
iff j < kv_len[n] and j <= q_pos[n, l] (causal within the new tokens, full over the cached prefix; the new
tokens' K/V are written before attention). Rows with q_pos < 0 are padding and return 0.
GQA: query head h uses kv head h // (Hq / Hkv). Softmax in float32 with scale sm_scale.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST
DECODE_SPAN_BYTES = 1 << 20     # K and V a decode span gathers for all its rows (paged_attention_reference)


def write_kv_reference(k_pages, v_pages, k, v, slot_mapping):
    """k, v: [T, Hkv, D]; slot_mapping: [T] flat slot per token (padding -> a slot of dummy block 0)."""
    bs = k_pages.shape[2]
    block, row = slot_mapping // bs, slot_mapping % bs

    def write(pages, x):
        return pages.at[:, block, row].set(jnp.swapaxes(x, 0, 1).astype(pages.dtype))

    # Indexed on the pages themselves, not on a flat [Hkv, slots, D] view: with one token XLA:CPU turns the scatter
    # into a dynamic update, which ran on a copy of the reshaped view (a 1-row decode step copied both pages of every
    # layer) and runs in place here. The same speed from 2 to 1024 tokens.
    return write(k_pages, k), write(v_pages, v)


def write_kv_leading(k_pages, v_pages, k, v, slot_mapping):
    """write_kv_reference's result, as a scatter whose indexed dims are the pages' leading dims (head, block,
    row), for XLA:GPU. There a scatter indexed on other dims than the leading ones (the reference's block and row
    with every head) is first rewritten with its operand transposed (XLA's ScatterSimplifier): a copy of the whole
    pages, as big as the KV cache of a layer (the small bench model's first step on an H200 asked for 47 GiB)."""
    hkv, _, bs, _ = k_pages.shape
    heads = jnp.arange(hkv, dtype=slot_mapping.dtype)[:, None]                          # [Hkv, 1]
    block, row = (slot_mapping // bs)[None, :], (slot_mapping % bs)[None, :]           # [1, T]

    def write(pages, x):
        return pages.at[heads, block, row].set(jnp.swapaxes(x, 0, 1).astype(pages.dtype))    # [Hkv, T, D]

    return write(k_pages, k), write(v_pages, v)


def paged_attention_reference(q, k_pages, v_pages, block_table, kv_len, q_pos, *, sm_scale, span_blocks=None,
                              leading_gather=False):
    """Online softmax over spans of `span_blocks` pages; memory O(N * span) instead of O(N * max_len), and the
    loop stops after the span holding the longest kv_len in the batch, so the cost follows the real context, not
    max_model_len. Every row pays for the whole last span and short spans cost loop steps. By default a decode span
    (one query per group) gathers about DECODE_SPAN_BYTES of K and V for all its rows (float32), so they stay in
    cache: XLA:CPU, Hkv=2, 22-page tables, ~100-230 tokens, p10 of 60 calls, D=256 (the small bench model): 16 rows
    1-page spans 3.1 ms, 2-page 2.7, 4-page 3.9, 8-page 4.8; 64 rows 1-page 11.8 ms, 4-page 24.6, 8-page 32; one row:
    4 to 24 pages all 0.2-0.4 ms. D=32 (tiny): 16 rows 2 to 8 pages 0.54-0.59 ms, 22 pages 0.82; 64 rows 2-page 2.0,
    4-page 2.4, 22-page 4.2. A prefill span (C queries per group share each gathered page) is 16 pages: 40 groups of
    32 queries over ~250 tokens: 4-page 67 ms, 16-page 56; 4 groups of 64 queries at 4096 tokens: 8-page 136 ms,
    16-page 117, 32-page 125, 64-page 138.

    q: [N, L, Hq, D]; k_pages, v_pages: [Hkv, blocks, bs, D]; block_table: [N, MB] int32; kv_len: [N];
    q_pos: [N, L]. Returns [N, L, Hq, D] float32.
    """
    n, length, hq, d = q.shape
    hkv, bs = k_pages.shape[0], k_pages.shape[2]
    group = hq // hkv
    mb = block_table.shape[1]
    if span_blocks is None:
        page_bytes = n * bs * hkv * d * 2 * 4                                         # K and V, every row
        span_blocks = max(1, DECODE_SPAN_BYTES // page_bytes) if length == 1 else 16
        # at least two spans: with one span over the whole table XLA:CPU copies the V pages (twice) in a 1-row step
        span_blocks = min(span_blocks, max(1, -(-mb // 2)))
    span_blocks = min(span_blocks, mb)
    num_spans = -(-mb // span_blocks)
    table = jnp.pad(block_table, ((0, 0), (0, num_spans * span_blocks - mb)))
    table = table.reshape(n, num_spans, span_blocks).transpose(1, 0, 2)              # [S, N, span]
    # Queries [Hkv, N, L*G, D] (row = l * G + g): the batch dims (kv head, group) lead in every dot.
    rows = length * group
    qg = (q.astype(jnp.float32) * sm_scale).reshape(n, length, hkv, group, d).transpose(2, 0, 1, 3, 4)
    qg = qg.reshape(hkv, n, rows, d)
    row_pos = jnp.repeat(q_pos, group, axis=1)                                        # [N, L*G]
    span_tokens = span_blocks * bs
    live_spans = jnp.minimum((jnp.max(kv_len) + span_tokens - 1) // span_tokens, num_spans)

    def step(span_idx, carry):
        m, l, acc = carry
        blocks = jax.lax.dynamic_index_in_dim(table, span_idx, 0, keepdims=False)      # [N, span]
        # leading_gather (the GPU fallback): index (head, block), the pages' leading dims; XLA:GPU would copy the
        # whole pages (transposed) to gather pages[:, blocks]. The CPU keeps the measured form.
        index = (jnp.arange(hkv)[:, None, None], blocks[None]) if leading_gather else (slice(None), blocks)
        k = k_pages[index].reshape(hkv, n, span_tokens, d).astype(jnp.float32)
        v = v_pages[index].reshape(hkv, n, span_tokens, d).astype(jnp.float32)
        key_pos = span_idx * span_tokens + jnp.arange(span_tokens)
        visible = (key_pos[None, None, :] < kv_len[:, None, None]) & (key_pos[None, None, :] <= row_pos[:, :, None])
        s = jnp.einsum("hnqd,hnkd->hnqk", qg, k, precision=_HIGHEST)
        s = jnp.where(visible[None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("hnqk,hnkd->hnqd", p, v, precision=_HIGHEST)
        return m_new, l, acc

    init = (jnp.full((hkv, n, rows), -jnp.inf, jnp.float32), jnp.zeros((hkv, n, rows), jnp.float32),
            jnp.zeros((hkv, n, rows, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, live_spans, step, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(hkv, n, length, group, d).transpose(1, 2, 0, 3, 4).reshape(n, length, hq, d)
