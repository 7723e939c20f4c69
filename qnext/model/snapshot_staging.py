"""Narrow device snapshot rows inside the step: the kernels index only the float32 state buffers, so a step's reads
of snapshot rows and its captures move between those and the narrow pool here (docs/fp8.md).

With a separate pool (CacheBuffers.snapshot_recurrent; mamba_ssm_cache_dtype narrower than float32), a row id at
or past `first_pool_row` is a snapshot in the pool. `stage` rewrites a step's rows so that the kernels never see one:
- a group that starts from a snapshot (is_first, read_row a pool id) starts from its own live row (write_row)
  instead, into which `restore_rows` has copied the snapshot, widened to float32, before the layer's kernels (the
  live row's old contents are not needed: the segment starts from the snapshot; later groups carry the state);
- a capture at a segment's end (decode rows, a prefill segment's last group) is the state the kernels leave in
  write_row: the kernels capture nothing, and `capture_rows` narrows write_row into the pool after them;
- a capture in the middle of a segment goes to a staging row (the last `num_staging_rows` rows of the float32
  buffers, in order of the groups), which `capture_rows` narrows into the pool. The scheduler reserves at most
  num_staging_rows such captures a step; one past them would capture nothing (the kernels write no row for it).
Both copies run one row at a time over only the rows that move (a step restores and captures few rows: a masked
gather or scatter of every group would move them all), inside the donated step, updating the buffers in place.
Without a pool (the float32 default) nothing here runs and the step is exactly as before.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cache.device_buffers import CacheBuffers
from qnext.model.step_inputs import StepInputs


class SnapshotMoves(NamedTuple):
    """A step's copies between the float32 rows and the pool; entries [count:] of each order are not copied."""
    restore_order: jnp.ndarray   # [G] int32 entries whose snapshot is restored, first
    restore_count: jnp.ndarray   # [] int32
    pool_src: jnp.ndarray        # [G] int32 pool row read (restores)
    live_dst: jnp.ndarray        # [G] int32 float32 row written (restores)
    capture_order: jnp.ndarray   # [G] int32 entries that capture into the pool, first
    capture_count: jnp.ndarray   # [] int32
    live_src: jnp.ndarray        # [G] int32 float32 row read (captures: write_row or a staging row)
    pool_dst: jnp.ndarray        # [G] int32 pool row written (captures)


def stage(buffers: CacheBuffers, inputs: StepInputs) -> tuple[StepInputs, SnapshotMoves | None]:
    """The step's inputs with no pool row left in them, and the copies that stand in for those rows (None: the
    buffers have no separate pool; the inputs are returned as they are)."""
    first = buffers.first_pool_row
    if first is None:
        return inputs, None
    views = (inputs.decode, inputs.prefill)
    cat = lambda name: jnp.concatenate([getattr(v, name) for v in views])   # noqa: E731  [G] over both views
    read, write, capture = cat("read_row"), cat("write_row"), cat("capture_row")
    is_first, is_last = cat("is_first"), cat("is_last")
    restore = is_first & (read >= first) & (write > 0)
    to_pool = capture >= first
    mid = to_pool & ~is_last
    rank = jnp.cumsum(mid) - 1
    staged = mid & (rank < buffers.num_staging_rows)
    staging_row = first - buffers.num_staging_rows + rank
    kernel_capture = jnp.where(staged, staging_row, jnp.where(to_pool, 0, capture))
    captured = to_pool & ((is_last & (write > 0)) | staged)
    moves = SnapshotMoves(
        restore_order=_first(restore), restore_count=jnp.sum(restore, dtype=jnp.int32),
        pool_src=jnp.maximum(read - first, 0), live_dst=write,
        capture_order=_first(captured), capture_count=jnp.sum(captured, dtype=jnp.int32),
        live_src=jnp.where(is_last, write, staging_row), pool_dst=jnp.maximum(capture - first, 0))
    new_read = jnp.where(restore, write, read)
    n = views[0].read_row.shape[0]
    decode, prefill = (dataclasses.replace(v, read_row=r, capture_row=c) for v, r, c in
                       zip(views, (new_read[:n], new_read[n:]), (kernel_capture[:n], kernel_capture[n:])))
    return dataclasses.replace(inputs, decode=decode, prefill=prefill), moves


def restore_rows(conv, recurrent, pool_conv, pool_recurrent, moves: SnapshotMoves):
    """One layer, before its kernels: the snapshots the step reads, widened into their live rows. -> (conv,
    recurrent, pool_conv, pool_recurrent), the pool unchanged. conv [R, K-1, C], recurrent [R, Hv, dk, dv] float32;
    pool_* [S, ...] (recurrent narrow)."""
    (conv, recurrent), (pool_conv, pool_recurrent) = _copy(
        (conv, recurrent), (pool_conv, pool_recurrent), moves.pool_src, moves.live_dst, moves.restore_order,
        moves.restore_count)
    return conv, recurrent, pool_conv, pool_recurrent


def capture_rows(conv, recurrent, pool_conv, pool_recurrent, moves: SnapshotMoves):
    """One layer, after its kernels: the captured states, narrowed (rounded to nearest) into the pool. -> (conv,
    recurrent, pool_conv, pool_recurrent), the live rows unchanged."""
    (pool_conv, pool_recurrent), (conv, recurrent) = _copy(
        (pool_conv, pool_recurrent), (conv, recurrent), moves.live_src, moves.pool_dst, moves.capture_order,
        moves.capture_count)
    return conv, recurrent, pool_conv, pool_recurrent


def _first(flags):
    """[G] int32: the indices of the set flags first (in order), then the rest."""
    return jnp.argsort(~flags, stable=True).astype(jnp.int32)


def _copy(targets, sources, src, dst, order, count):
    """targets[k][dst[i]] = sources[k][src[i]] (cast to the target's dtype) for i in order[:count], one row at a
    time (a while loop: its trip count is the rows that move, not the step's groups). -> (targets, sources).
    The sources ride in the loop's carry, unchanged, and the caller goes on with the loop's (read from outside it,
    each would be copied whole into the loop: a donated buffer that the step also returns). The loop sits in a
    cond that skips it when no row moves: XLA:CPU runs a bf16 row update as a float32 one, widening the whole
    buffer around it, and hoists the widening of a loop's read-only bf16 buffer out of the loop, which would cost
    every step that much even when nothing moves (XLA:GPU updates bf16 in place)."""
    def put(j, carry):
        arrays, sources = carry
        i = order[j]
        return tuple(jax.lax.dynamic_update_index_in_dim(
            t, jax.lax.dynamic_index_in_dim(s, src[i], keepdims=False).astype(t.dtype), dst[i], 0)
            for t, s in zip(arrays, sources)), sources

    carry = (tuple(targets), tuple(sources))
    return jax.lax.cond(count > 0, lambda c: jax.lax.fori_loop(0, count, put, c), lambda c: c, carry)
