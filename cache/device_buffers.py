"""The device buffers the cache manager's bookkeeping refers to: their layout, allocation and how a row id addresses
them. With cache/buffer_copies.py (the jitted copies in and out of them), cache/host_tier_buffers.py (the host tier's
arrays and the copies between the tiers) and cache/fork_buffer_copies.py (the forks' copies inside them), the modules of
`cache/` that import jax.

KV pages per full-attention layer, and state rows per linear-attention layer: row 0 is the zero state (never written),
rows 1..num_live_slots hold live sequences, the rest are the prefix-snapshot pool (docs/CONTRACTS.md). Restoring
and capturing a snapshot are reads and writes of rows inside the model step, so those need no copy kernels. The buffers go
into every step and come back out of it, donated.

Narrow snapshot rows (mamba_ssm_cache_dtype narrower than float32; docs/fp8.md): the snapshot pool is a second
buffer per layer, `snapshot_conv` [S, K-1, conv_dim] in the model dtype and `snapshot_recurrent` [S, Hv, dk, dv] in
the snapshot dtype, and the float32 buffers `conv` / `recurrent` hold row 0, the live rows and `num_staging_rows`
staging rows (the last ones) for the step's mid-sequence captures. Snapshot ids keep their numbering after those
rows: id r is pool row r - first_pool_row. The kernels index only the float32 buffers (qnext/model/snapshot_staging.py
moves rows between the two inside the step); the copies address either by row id (`split_rows`).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct


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
