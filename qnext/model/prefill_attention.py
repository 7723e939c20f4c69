"""The prefill view's attention on the jnp path (CPU): a long prefill reads its cached context once a step.

The step's prefill view holds N groups of up to C queries (C: the delta rule's chunk, 32 on CPU), a sequence's groups
consecutive, its first group marked `is_first`. Attending group by group (pallas_kernels' paged attention) gathers
the sequence's whole context once per group: a 2048-token step of one long prompt read its pages 64 times, and every
group looped over the spans of the longest context in the batch.

Here the sequence with the most groups, when it holds at least half of the view's groups (a long prompt's chunk:
the case whose cost grows with the context), is attended as ONE group of all N * C rows (the whole view, the rows of
other sequences masked: at most 2x its rows computed), so its pages are read once. The remaining groups (short
prompts, the tails and heads of others) are attended group by group as before, but over the spans of their own
contexts only (the big sequence's kv_len set to 0 there). Two fixed-shape calls, so one more compilation of the
span loop than before (XLA:CPU, 72 groups of 32: ~2.3 s -> ~6.7 s on the loaded 2-core machine), not one per
window size; views of fewer than MIN_GROUPS groups keep the group-wise call alone.

The numbers are the reference's: the same online softmax over spans of pages (8 pages a span in the window, so its
rounding differs from the group-wise spans of 16 by float32 ulps), the same masking (key j visible to a query at
position p iff j < kv_len and j <= p), float32; spans that a row cannot see change nothing (exp(-inf) = 0, a
correction factor of 1).
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention import paged_attention_reference

# Views of fewer groups (small max_num_batched_tokens) keep the single group-wise call: at most this many reads of
# a context a step, and one compilation of the span loop instead of two.
MIN_GROUPS = 16
# Pages per span of the whole-view window. XLA:CPU, tiny attention (4 / 2 heads of 32), a 32k context, min of 3:
# 2304 queries 4 pages 1.02 s, 8 pages 0.68-0.72, 16 pages 1.06-1.11, 32 pages 2.1-2.6; 768 queries 8 and 16 pages
# both 0.61 s (the reference's 16 was measured on groups of <= 64 queries).
WINDOW_SPAN_BLOCKS = 8


def largest_run(is_first, length):
    """(first group, end group, number of groups) of the sequence with the most groups in the view."""
    n = is_first.shape[0]
    group = jnp.arange(n)
    valid = length > 0
    run = jnp.cumsum(is_first & valid) - 1                       # run index of each valid group
    sizes = jnp.zeros(n, jnp.int32).at[jnp.where(valid, run, n)].add(1, mode="drop")
    biggest = jnp.argmax(sizes)
    members = valid & (run == biggest)
    start = jnp.argmax(members)
    return start, jnp.where(members, group + 1, 0).max(), sizes[biggest]


def prefill_attention_by_sequence(q, k_pages, v_pages, block_table, kv_len, q_pos, is_first, length, *, sm_scale):
    """q: [N, C, Hq, D] prefill groups; block_table [N, MB], kv_len [N], q_pos [N, C] (-1: padding row), is_first
    [N] bool, length [N] (0: a padding group). Returns [N, C, Hq, D] float32, equal to paged_attention_reference on
    the same groups."""
    n, c = q.shape[:2]
    start, end, size = largest_run(is_first, length)
    whole = 2 * size >= n                                        # the largest sequence takes the whole-view window
    in_big = whole & (jnp.arange(n) >= start) & (jnp.arange(n) < end)          # [N]
    big_pos = jnp.where(in_big[:, None], q_pos, -1).reshape(1, n * c)
    big_len = jnp.where(whole, kv_len[start], 0)[None]         # 0: no window, the span loop runs no step
    out_big = paged_attention_reference(q.reshape((1, n * c) + q.shape[2:]), k_pages, v_pages,
                                        block_table[start][None], big_len, big_pos, sm_scale=sm_scale,
                                        span_blocks=WINDOW_SPAN_BLOCKS)
    out_rest = paged_attention_reference(q, k_pages, v_pages, block_table, jnp.where(in_big, 0, kv_len),
                                         jnp.where(in_big[:, None], -1, q_pos), sm_scale=sm_scale)
    return out_big.reshape(q.shape) + out_rest
