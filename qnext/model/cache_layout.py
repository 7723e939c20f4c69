"""The cache buffers' layout for a model config (the buffers themselves live in cache/device_buffers.py)."""
from __future__ import annotations

import numpy as np

from cache.cache_dtypes import kv_storage_dtype, snapshot_storage_dtype
from cache.device_buffers import CacheBuffers, CacheLayout, allocate_cache_buffers
from qnext.config import ModelConfig


def cache_layout(cfg: ModelConfig, dtype, extra_kv_layers: int = 0, kv_cache_dtype: str = "auto",
                 mamba_ssm_cache_dtype: str = "auto") -> CacheLayout:
    """extra_kv_layers: KV layers after the model's own (the MTP head's, when it drafts), paged like them.
    kv_cache_dtype, mamba_ssm_cache_dtype: the engine options (cache/cache_dtypes.py)."""
    return CacheLayout(
        num_kv_layers=len(cfg.full_layer_ids) + extra_kv_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        num_state_layers=len(cfg.linear_layer_ids), conv_width=cfg.linear_conv_kernel_dim, conv_dim=cfg.conv_dim,
        num_v_heads=cfg.linear_num_value_heads, k_head_dim=cfg.linear_key_head_dim,
        v_head_dim=cfg.linear_value_head_dim, dtype=np.dtype(dtype).name,
        kv_dtype=kv_storage_dtype(kv_cache_dtype, np.dtype(dtype).name),
        snapshot_dtype=snapshot_storage_dtype(mamba_ssm_cache_dtype))


def model_cache_buffers(cfg: ModelConfig, *, num_blocks: int, block_size: int, num_state_rows: int,
                        dtype, kv_cache_dtype: str = "auto") -> CacheBuffers:
    return allocate_cache_buffers(cache_layout(cfg, dtype, kv_cache_dtype=kv_cache_dtype), num_blocks=num_blocks,
                                  block_size=block_size, num_state_rows=num_state_rows)
