"""The device buffers the cache manager's bookkeeping refers to and the copies between them and the host tier (with
cache/fork_copies.py, the forks' copies inside them, the modules of `cache/` that import jax; cache/persisted_cache.py
reads through this one).

KV pages per full-attention layer, and state rows per linear-attention layer: row 0 is the zero state (never written),
rows 1..num_live_slots hold live sequences, the rest are the prefix-snapshot pool (docs/CONTRACTS.md). Restoring
and capturing a snapshot are reads and writes of rows inside the model step, so those need no copy kernels. The buffers go
into every step and come back out of it, donated.

Narrow snapshot rows (mamba_ssm_cache_dtype narrower than float32; docs/fp8.md): the snapshot pool is a second
buffer per layer, `snapshot_conv` [S, K-1, conv_dim] in the model dtype and `snapshot_recurrent` [S, Hv, dk, dv] in
the snapshot dtype, and the float32 buffers `conv` / `recurrent` hold row 0, the live rows and `num_staging_rows`
staging rows (the last ones) for the step's mid-sequence captures. Snapshot ids keep their numbering after those
rows: id r is pool row r - first_pool_row. The kernels index only the float32 buffers (qnext/model/snapshot_staging.py
moves rows between the two inside the step); the copies here address either by row id (`split_rows`).

The host tier keeps KV blocks and snapshot rows in numpy arrays laid out like the device buffers
(slot = block / row): per full-attention layer (k, v) [Hkv, num_host_blocks, block_size, D],
per linear-attention layer conv [num_host_snapshots, K-1, conv_dim] and recurrent [num_host_snapshots, Hv, dk, dv]
in the layout's snapshot dtype (float32, or narrower with mamba_ssm_cache_dtype: rounded when saved, widened to
float32 when loaded). `apply` runs a TransferPlan (cache/transfers.py) that the cache manager decided: phase by phase, the
saves (one jitted gather per kind, then one device -> host copy) before the loads (one host gather, one host ->
device copy and one jitted scatter per kind, the device buffers donated). Index vectors are padded to powers of
two so that few shapes compile; padded gathers read block / row 0, padded scatters write out of range and are
dropped (the zero state row is never written); at most MAX_COPY blocks (rows) go in one call. On CPU the
"device" is host memory and the same code is a copy.

The forks' copies inside the buffers are cache/fork_copies.py's.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from cache.stats import TierStats
from cache.transfers import TransferPlan


@struct.dataclass
class CacheBuffers:
    kv: tuple          # per full-attention layer: (k_pages, v_pages), each [Hkv, num_blocks, block_size, D]
    conv: tuple        # per linear-attention layer: [R, K-1, conv_dim] model dtype
    recurrent: tuple   # per linear-attention layer: [R, Hv, dk, dv] float32
    # The narrow snapshot pool (empty: the snapshots are rows of conv / recurrent, the single-buffer layout):
    snapshot_conv: tuple = ()        # per linear-attention layer: [S, K-1, conv_dim] model dtype
    snapshot_recurrent: tuple = ()   # per linear-attention layer: [S, Hv, dk, dv] mamba_ssm_cache_dtype
    num_staging_rows: int = struct.field(pytree_node=False, default=0)   # the last rows of conv / recurrent

    @property
    def first_pool_row(self) -> int | None:
        """The row id of the pool's row 0 (= rows of the float32 buffers); None without a separate pool."""
        return self.conv[0].shape[0] if self.snapshot_recurrent else None


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Sizes of the buffers, in plain numbers (no model config here)."""

    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    num_state_layers: int
    conv_width: int                # K; the conv state keeps K - 1 inputs
    conv_dim: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: str = "float32"
    kv_dtype: str | None = None        # the KV pages' dtype (cache/cache_dtypes.py); None: `dtype`
    snapshot_dtype: str = "float32"    # stored snapshots' recurrent state (device pool, host tier, persisted)

    @property
    def kv_storage(self) -> str:
        return self.kv_dtype or self.dtype

    def kv_bytes_per_block(self, block_size: int) -> int:
        return (2 * self.num_kv_layers * block_size * self.num_kv_heads * self.head_dim
                * jnp.dtype(self.kv_storage).itemsize)

    @property
    def state_bytes_per_row(self) -> int:
        conv = (self.conv_width - 1) * self.conv_dim * jnp.dtype(self.dtype).itemsize
        recurrent = self.num_v_heads * self.k_head_dim * self.v_head_dim * 4
        return self.num_state_layers * (conv + recurrent)

    @property
    def narrow_snapshots(self) -> bool:
        """Whether stored snapshots are narrower than the live float32 state (a separate device pool)."""
        return jnp.dtype(self.snapshot_dtype) != jnp.dtype(jnp.float32)

    @property
    def snapshot_bytes_per_row(self) -> int:
        """A stored snapshot row (device pool, host tier): the recurrent state in `snapshot_dtype`."""
        conv = (self.conv_width - 1) * self.conv_dim * jnp.dtype(self.dtype).itemsize
        recurrent = self.num_v_heads * self.k_head_dim * self.v_head_dim * jnp.dtype(self.snapshot_dtype).itemsize
        return self.num_state_layers * (conv + recurrent)


def num_state_rows(num_live_slots: int, num_snapshot_slots: int) -> int:
    return 1 + num_live_slots + num_snapshot_slots


def allocate_cache_buffers(layout: CacheLayout, *, num_blocks: int, block_size: int, num_state_rows: int,
                           num_pool_rows: int = 0, num_staging_rows: int = 0) -> CacheBuffers:
    """num_state_rows: rows of the float32 state buffers (every state row in the single-buffer layout; with a pool,
    the zero row, the live rows and the staging rows). num_pool_rows > 0: a separate snapshot pool of that many rows
    (conv in the model dtype, recurrent in the layout's snapshot dtype)."""
    if num_pool_rows and not num_staging_rows:
        raise ValueError(f"num_pool_rows={num_pool_rows} needs num_staging_rows > 0 (the step's mid-sequence "
                         "captures are staged in float32 rows)")
    page = (layout.num_kv_heads, num_blocks, block_size, layout.head_dim)   # head-major (paged_attention.py)
    kv = tuple((jnp.zeros(page, layout.kv_storage), jnp.zeros(page, layout.kv_storage))
               for _ in range(layout.num_kv_layers))
    conv = tuple(jnp.zeros((num_state_rows, layout.conv_width - 1, layout.conv_dim), layout.dtype)
                 for _ in range(layout.num_state_layers))
    recurrent = tuple(jnp.zeros((num_state_rows, layout.num_v_heads, layout.k_head_dim, layout.v_head_dim), jnp.float32)
                      for _ in range(layout.num_state_layers))
    if not num_pool_rows or not layout.num_state_layers:
        return CacheBuffers(kv=kv, conv=conv, recurrent=recurrent)
    pool_conv = tuple(jnp.zeros((num_pool_rows, layout.conv_width - 1, layout.conv_dim), layout.dtype)
                      for _ in range(layout.num_state_layers))
    pool_recurrent = tuple(jnp.zeros((num_pool_rows, layout.num_v_heads, layout.k_head_dim, layout.v_head_dim),
                                     layout.snapshot_dtype) for _ in range(layout.num_state_layers))
    return CacheBuffers(kv=kv, conv=conv, recurrent=recurrent, snapshot_conv=pool_conv,
                        snapshot_recurrent=pool_recurrent, num_staging_rows=num_staging_rows)


# The float32 buffers' fields and the pool's, by part (split_rows).
LIVE_PART, POOL_PART = ("conv", "recurrent"), ("snapshot_conv", "snapshot_recurrent")


def split_rows(buffers: CacheBuffers, rows: list[int]) -> list[tuple[tuple[str, str], list[int], list[int]]]:
    """(part, positions in `rows`, indices in that part's buffers) for the parts that the row ids address: every
    row in the float32 buffers, or with a pool, ids from first_pool_row in the pool (at id - first_pool_row)."""
    first = buffers.first_pool_row
    if first is None:
        return [(LIVE_PART, list(range(len(rows))), list(rows))] if rows else []
    live = [(i, r) for i, r in enumerate(rows) if r < first]
    pool = [(i, r - first) for i, r in enumerate(rows) if r >= first]
    return [(part, [i for i, _ in pairs], [r for _, r in pairs]) for part, pairs in ((LIVE_PART, live),
                                                                                     (POOL_PART, pool)) if pairs]


def state_part(buffers: CacheBuffers, part: tuple[str, str]) -> tuple[tuple, tuple]:
    """(conv, recurrent) per-layer tuples of one part of the buffers."""
    return getattr(buffers, part[0]), getattr(buffers, part[1])


# Blocks (rows) per jitted copy: bounds the temporary device memory of a gather and the shapes that compile.
MAX_COPY = 256


@dataclasses.dataclass
class HostTierBuffers:
    kv: tuple          # per full-attention layer: (k, v), each [Hkv, num_host_blocks, block_size, D] np
    conv: tuple        # per linear-attention layer: [num_host_snapshots, K-1, conv_dim] np
    recurrent: tuple   # per linear-attention layer: [num_host_snapshots, Hv, dk, dv] np, the snapshot dtype

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves((self.kv, self.conv, self.recurrent)))

    def block_bytes(self) -> int:
        return sum(k[:, 0].nbytes + v[:, 0].nbytes for k, v in self.kv)

    def row_bytes(self) -> int:
        return sum(c[0].nbytes + r[0].nbytes for c, r in zip(self.conv, self.recurrent))

    def apply(self, plan: TransferPlan, buffers: CacheBuffers, stats: TierStats) -> CacheBuffers:
        """Runs the plan's copies on `buffers` (donated) and this tier's arrays; returns the new device buffers."""
        for phase in plan.phases:
            t0 = time.perf_counter()
            for slots, blocks in _chunks(phase.kv_saves):
                got = jax.device_get(_gather_blocks(buffers.kv, padded_indices(blocks, 0)))
                for (k, v), (gk, gv) in zip(self.kv, got):
                    k[:, slots], v[:, slots] = gk[:, :len(slots)], gv[:, :len(slots)]
            for slots, rows in _chunks(phase.state_saves):
                for part, at, index in split_rows(buffers, rows):
                    conv, recurrent = jax.device_get(_gather_rows(state_part(buffers, part), padded_indices(index, 0)))
                    to = [slots[i] for i in at]
                    for c, r, gc, gr in zip(self.conv, self.recurrent, conv, recurrent):
                        c[to], r[to] = gc[:len(to)], gr[:len(to)]
            t1 = time.perf_counter()
            for blocks, slots in _chunks(phase.kv_loads):
                padded = padded_indices(slots, 0)
                values = tuple((k[:, padded], v[:, padded]) for k, v in self.kv)
                kv = _scatter_blocks(buffers.kv, padded_indices(blocks, buffers.kv[0][0].shape[1]), values)
                buffers = buffers.replace(kv=kv)
            for rows, slots in _chunks(phase.state_loads):
                for part, at, index in split_rows(buffers, rows):
                    padded = padded_indices([slots[i] for i in at], 0)
                    values = (tuple(c[padded] for c in self.conv), tuple(r[padded] for r in self.recurrent))
                    state = state_part(buffers, part)
                    conv, recurrent = _scatter_rows(state, padded_indices(index, state[0][0].shape[0]), values)
                    buffers = buffers.replace(**{part[0]: conv, part[1]: recurrent})
            if phase.kv_loads or phase.state_loads:
                jax.block_until_ready(buffers)
            t2 = time.perf_counter()
            block, row = self.block_bytes(), self.row_bytes()
            stats.bytes_to_host += len(phase.kv_saves) * block + len(phase.state_saves) * row
            stats.bytes_to_device += len(phase.kv_loads) * block + len(phase.state_loads) * row
            stats.seconds_to_host += t1 - t0
            stats.seconds_to_device += t2 - t1
        return buffers

    def warm_up(self, buffers: CacheBuffers) -> CacheBuffers:
        """Compiles every copy shape (powers of two up to MAX_COPY) on copies that read block / row 0 and write
        nothing; returns the buffers."""
        num_blocks = buffers.kv[0][0].shape[1]
        parts = [LIVE_PART] + ([POOL_PART] if buffers.first_pool_row is not None else [])
        size = 1
        while size <= MAX_COPY:
            zeros, nowhere = np.zeros(size, np.int32), np.full(size, num_blocks, np.int32)
            if self.kv[0][0].shape[1]:
                jax.block_until_ready(_gather_blocks(buffers.kv, zeros))
                values = tuple((k[:, zeros], v[:, zeros]) for k, v in self.kv)
                buffers = buffers.replace(kv=_scatter_blocks(buffers.kv, nowhere, values))
            for part in parts if self.conv and self.conv[0].shape[0] else ():
                state = state_part(buffers, part)
                jax.block_until_ready(_gather_rows(state, zeros))
                values = (tuple(c[zeros] for c in self.conv), tuple(r[zeros] for r in self.recurrent))
                conv, recurrent = _scatter_rows(state, np.full(size, state[0][0].shape[0], np.int32), values)
                buffers = buffers.replace(**{part[0]: conv, part[1]: recurrent})
            size *= 2
        return jax.block_until_ready(buffers)


def allocate_host_buffers(layout: CacheLayout, *, num_blocks: int, block_size: int,
                          num_snapshots: int) -> HostTierBuffers:
    """Zeroed host arrays for `num_blocks` KV blocks and `num_snapshots` snapshot rows (whole, not sharded)."""
    dtype, kv_dtype = jnp.dtype(layout.dtype), jnp.dtype(layout.kv_storage)
    page = (layout.num_kv_heads, num_blocks, block_size, layout.head_dim)
    return HostTierBuffers(
        kv=tuple((np.zeros(page, kv_dtype), np.zeros(page, kv_dtype)) for _ in range(layout.num_kv_layers)),
        conv=tuple(np.zeros((num_snapshots, layout.conv_width - 1, layout.conv_dim), dtype)
                   for _ in range(layout.num_state_layers)),
        recurrent=tuple(np.zeros((num_snapshots, layout.num_v_heads, layout.k_head_dim, layout.v_head_dim),
                                 jnp.dtype(layout.snapshot_dtype)) for _ in range(layout.num_state_layers)))


def gather_device_blocks(kv: tuple, blocks: list[int]) -> tuple:
    """Per KV layer of `kv` (k, v) [Hkv, len(blocks), block_size, D] numpy: the device blocks' contents."""
    pieces = []
    for i in range(0, len(blocks), MAX_COPY):
        part = blocks[i:i + MAX_COPY]
        got = jax.device_get(_gather_blocks(kv, padded_indices(part, 0)))
        pieces.append([(k[:, :len(part)], v[:, :len(part)]) for k, v in got])
    return tuple((np.concatenate([p[layer][0] for p in pieces], axis=1),
                  np.concatenate([p[layer][1] for p in pieces], axis=1)) for layer in range(len(kv)))


def gather_device_rows(buffers: CacheBuffers, rows: list[int], layer: int, kind: str) -> np.ndarray:
    """One linear-attention layer's `kind` ("conv" or "recurrent") of the state rows `rows` (live rows or snapshot
    ids), [len(rows), ...] numpy in the stored dtype (the narrowest of the parts read)."""
    parts = split_rows(buffers, rows)
    arrays = {part: state_part(buffers, part)[kind == "recurrent"][layer] for part, _, _ in parts}
    first = arrays.get(LIVE_PART, arrays.get(POOL_PART, getattr(buffers, kind)[layer]))
    dtype = min((a.dtype for a in arrays.values()), key=lambda d: jnp.dtype(d).itemsize, default=first.dtype)
    out = np.zeros((len(rows),) + tuple(first.shape[1:]), jnp.dtype(dtype))
    for part, at, index in parts:
        state = ((arrays[part],), ()) if kind == "conv" else ((), (arrays[part],))
        for i in range(0, len(index), MAX_COPY):
            chunk = index[i:i + MAX_COPY]
            c, r = jax.device_get(_gather_rows(state, padded_indices(chunk, 0)))
            out[at[i:i + len(chunk)]] = (c or r)[0][:len(chunk)]
    return out


def gather_live_rows(buffers: CacheBuffers, rows: list[int]) -> tuple[tuple, tuple]:
    """Every linear-attention layer's (conv, recurrent) of the live rows `rows` (the float32 buffers), each
    [len(rows), ...] numpy: one gather and one device-to-host copy for all layers."""
    first = buffers.first_pool_row
    if first is not None and any(row >= first for row in rows):
        raise ValueError(f"rows {rows} include snapshot ids (from {first}): live rows only")
    conv, recurrent = jax.device_get(_gather_rows(state_part(buffers, LIVE_PART), padded_indices(rows, 0)))
    return tuple(c[:len(rows)] for c in conv), tuple(r[:len(rows)] for r in recurrent)


def write_blocks_and_rows(buffers: CacheBuffers, blocks: list[int], kv: tuple, rows: list[int], conv: tuple,
                          recurrent: tuple) -> CacheBuffers:
    """Writes KV blocks and state rows computed elsewhere into the buffers (donated) -> the new buffers.
    kv: per KV layer of the buffers (k, v) [Hkv, len(blocks), block_size, D] numpy; conv / recurrent: per
    linear-attention layer [len(rows), ...]; all in the buffers' (global, not per-device) layout."""
    for i in range(0, len(blocks), MAX_COPY):
        part = padded_indices(blocks[i:i + MAX_COPY], buffers.kv[0][0].shape[1])
        values = tuple((_padded_values(k[:, i:i + MAX_COPY], len(part), 1),
                        _padded_values(v[:, i:i + MAX_COPY], len(part), 1)) for k, v in kv)
        buffers = buffers.replace(kv=_scatter_blocks(buffers.kv, part, values))
    for i in range(0, len(rows), MAX_COPY):
        part = padded_indices(rows[i:i + MAX_COPY], buffers.conv[0].shape[0])
        values = (tuple(_padded_values(c[i:i + MAX_COPY], len(part), 0) for c in conv),
                  tuple(_padded_values(r[i:i + MAX_COPY], len(part), 0) for r in recurrent))
        state = _scatter_rows((buffers.conv, buffers.recurrent), part, values)
        buffers = buffers.replace(conv=state[0], recurrent=state[1])
    return buffers


def _padded_values(x: np.ndarray, size: int, axis: int) -> np.ndarray:
    """x zero-padded along `axis` to `size` entries (the padded indices write out of range: dropped)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)


def _chunks(pairs: dict[int, int]):
    """(keys, values) of `pairs` in pieces of at most MAX_COPY."""
    keys, values = list(pairs), list(pairs.values())
    for i in range(0, len(keys), MAX_COPY):
        yield keys[i:i + MAX_COPY], values[i:i + MAX_COPY]


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_indices(indices: list[int], fill: int, size: int | None = None) -> np.ndarray:
    """indices as int32, padded with `fill` to `size` (default: the next power of two; bounded compilations)."""
    out = np.full(next_pow2(len(indices)) if size is None else size, fill, np.int32)
    out[:len(indices)] = indices
    return out


def page_index(pages, blocks):
    """Index of `blocks` [n] of every head of pages [Hkv, N, bs, D], on the pages' leading dims (head, block):
    pages[page_index(pages, blocks)] is pages[:, blocks]. XLA:GPU rewrites a gather or scatter indexed on other dims
    than the leading ones (pages[:, blocks]) with its operand transposed first: a copy of the whole pages."""
    return jnp.arange(pages.shape[0], dtype=blocks.dtype)[:, None], blocks[None, :]


@jax.jit
def _gather_blocks(kv, blocks):   # kv: per layer (k, v) [Hkv, N, bs, D]; blocks [n]
    return tuple((k[page_index(k, blocks)], v[page_index(v, blocks)]) for k, v in kv)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_blocks(kv, blocks, values):   # values: per layer (k, v) [Hkv, n, bs, D]; out-of-range blocks dropped
    return tuple((k.at[page_index(k, blocks)].set(vk.astype(k.dtype), mode="drop"),
                  v.at[page_index(v, blocks)].set(vv.astype(v.dtype), mode="drop"))
                 for (k, v), (vk, vv) in zip(kv, values))


@jax.jit
def _gather_rows(state, rows):   # state: (conv, recurrent), per layer [R, ...]; rows [n]
    conv, recurrent = state
    return tuple(c[rows] for c in conv), tuple(r[rows] for r in recurrent)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(state, rows, values):   # out-of-range rows dropped
    (conv, recurrent), (vc, vr) = state, values
    return (tuple(c.at[rows].set(x.astype(c.dtype), mode="drop") for c, x in zip(conv, vc)),
            tuple(r.at[rows].set(x.astype(r.dtype), mode="drop") for r, x in zip(recurrent, vr)))
