"""The device buffers the cache manager's bookkeeping refers to (the one module of `cache/` that imports jax).

KV pages per full-attention layer, and state rows per linear-attention layer: row 0 is the zero state (never written),
rows 1..num_live_slots hold live sequences, the rest are the prefix-snapshot pool (docs/CONTRACTS.md). Restoring
and capturing a snapshot are reads and writes of rows inside the model step, so there are no copy kernels here.
The buffers go into every step and come back out of it, donated.
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

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 2 * self.num_kv_layers * block_size * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def state_bytes_per_row(self) -> int:
        conv = (self.conv_width - 1) * self.conv_dim * jnp.dtype(self.dtype).itemsize
        recurrent = self.num_v_heads * self.k_head_dim * self.v_head_dim * 4
        return self.num_state_layers * (conv + recurrent)


def num_state_rows(num_live_slots: int, num_snapshot_slots: int) -> int:
    return 1 + num_live_slots + num_snapshot_slots


def allocate_cache_buffers(layout: CacheLayout, *, num_blocks: int, block_size: int,
                           num_state_rows: int) -> CacheBuffers:
    page = (layout.num_kv_heads, num_blocks, block_size, layout.head_dim)   # head-major (paged_attention.py)
    kv = tuple((jnp.zeros(page, layout.dtype), jnp.zeros(page, layout.dtype)) for _ in range(layout.num_kv_layers))
    conv = tuple(jnp.zeros((num_state_rows, layout.conv_width - 1, layout.conv_dim), layout.dtype)
                 for _ in range(layout.num_state_layers))
    recurrent = tuple(jnp.zeros((num_state_rows, layout.num_v_heads, layout.k_head_dim, layout.v_head_dim), jnp.float32)
                      for _ in range(layout.num_state_layers))
    return CacheBuffers(kv=kv, conv=conv, recurrent=recurrent)
