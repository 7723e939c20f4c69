"""The prefill view's attention on the jnp path (CPU): each sequence's cached context read once per step.

The step's prefill view holds groups of up to C queries (C: the delta rule's chunk, 32 on CPU), a sequence's groups
consecutive, its first group marked `is_first`. Attending group by group (pallas_kernels' paged attention) gathers
the sequence's whole context once per group: a 2048-token step of one sequence read its pages 64 times, and every
group looped over the spans of the longest context in the batch. Here each sequence (a run of groups from one
`is_first` to the next) is attended as ONE group of its concatenated rows, over its own context only.

Static shapes: a run of g groups takes a window of w groups, w the smallest of the classes 1, 2, 4, ..., N (N the
view's group count) that is >= g; the window's rows beyond the run are masked (q_pos = -1, output 0) and the branch
for w is one case of a lax.switch. So every sequence's pages are read once a step, at most 2x its rows computed.
The numbers are the reference's: same online softmax over spans of pages, same masking (key j visible to a query at
position p iff j < kv_len and j <= p), float32; a group's output rows are the same sums in a different batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import paged_attention_reference


def window_classes(num_groups: int) -> tuple[int, ...]:
    """The window sizes (in groups): powers of two below num_groups, then num_groups itself."""
    sizes, w = [], 1
    while w < num_groups:
        sizes.append(w)
        w *= 2
    return tuple(sizes) + (num_groups,)


def prefill_attention_by_sequence(q, k_pages, v_pages, block_table, kv_len, q_pos, is_first, length, *, sm_scale):
    """q: [N, C, Hq, D] prefill groups; block_table [N, MB], kv_len [N], q_pos [N, C] (-1: padding row), is_first
    [N] bool, length [N] (0: a padding group; padding groups come after the valid ones). Returns [N, C, Hq, D]
    float32, equal to paged_attention_reference on the same groups."""
    n, c = q.shape[:2]
    classes = window_classes(n)
    top = classes[-1]
    # padded by one top window of groups so that every window's dynamic slice stays in range (a clamped start
    # would misalign the rows)
    q_pad = jnp.pad(q, ((0, top), (0, 0), (0, 0), (0, 0)))
    pos_pad = jnp.pad(q_pos, ((0, top), (0, 0)), constant_values=-1)
    group = jnp.arange(n)
    out0 = jnp.zeros((n + top,) + q.shape[1:], jnp.float32)

    def window(w):
        def attend(start, end, out):
            rows = jax.lax.dynamic_slice_in_dim(q_pad, start, w, 0).reshape((1, w * c) + q.shape[2:])
            pos = jax.lax.dynamic_slice_in_dim(pos_pad, start, w, 0)
            pos = jnp.where((start + jnp.arange(w) < end)[:, None], pos, -1).reshape(1, w * c)  # this run only
            table = jax.lax.dynamic_slice_in_dim(block_table, start, 1, 0)
            seq_len = jax.lax.dynamic_slice_in_dim(kv_len, start, 1, 0)
            got = paged_attention_reference(rows, k_pages, v_pages, table, seq_len, pos, sm_scale=sm_scale)
            here = jax.lax.dynamic_slice_in_dim(out, start, w, 0)
            return jax.lax.dynamic_update_slice_in_dim(out, here + got.reshape((w,) + q.shape[1:]), start, 0)
        return attend

    branches = [window(w) for w in classes]
    sizes = jnp.asarray(classes, jnp.int32)

    def more(carry):
        start, _ = carry
        return (start < n) & (jnp.take(length, jnp.minimum(start, n - 1)) > 0)

    def step(carry):
        start, out = carry
        end = jnp.min(jnp.where((group > start) & (is_first | (length == 0)), group, n))   # the run's end
        size_class = jnp.argmax(sizes >= end - start)                                   # smallest window >= run
        return end, jax.lax.switch(size_class, branches, start, end, out)

    _, out = jax.lax.while_loop(more, step, (jnp.int32(0), out0))
    return out[:n]
