"""Device cache buffers the model step reads and writes (donated in and out of every step).

KV pages per full-attention layer, and state rows per linear-attention layer: row 0 is a dummy, rows
1..num_live_slots hold live sequences, the rest hold prefix snapshots (docs/CONTRACTS.md).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from qnext.config import ModelConfig


@struct.dataclass
class CacheBuffers:
    kv: tuple          # per full-attention layer: (k_pages, v_pages), each [num_blocks, block_size, Hkv, D]
    conv: tuple        # per linear-attention layer: [R, K-1, conv_dim] model dtype
    recurrent: tuple   # per linear-attention layer: [R, Hv, dk, dv] float32


def num_state_rows(num_live_slots: int, num_snapshot_slots: int) -> int:
    return 1 + num_live_slots + num_snapshot_slots


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    return 2 * len(cfg.full_layer_ids) * block_size * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def state_bytes_per_row(cfg: ModelConfig, dtype) -> int:
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * jnp.dtype(dtype).itemsize
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.linear_layer_ids) * (conv + recurrent)


def allocate_cache_buffers(cfg: ModelConfig, *, num_blocks: int, block_size: int, num_state_rows: int,
                           dtype) -> CacheBuffers:
    page = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv = tuple((jnp.zeros(page, dtype), jnp.zeros(page, dtype)) for _ in cfg.full_layer_ids)
    conv = tuple(jnp.zeros((num_state_rows, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype)
                 for _ in cfg.linear_layer_ids)
    recurrent = tuple(jnp.zeros((num_state_rows, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim), jnp.float32) for _ in cfg.linear_layer_ids)
    return CacheBuffers(kv=kv, conv=conv, recurrent=recurrent)
