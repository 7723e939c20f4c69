"""The cache an engine starts with: its byte budget, the split of that budget into KV blocks, live state rows and
snapshot rows (cache/sizing.py's rule), the device buffers of those sizes (made in their shards under tensor
parallelism), and the cache manager that owns them.

The budget, in vLLM's terms:
- `kv_cache_memory_bytes` when given (the way to size the cache on CPU);
- else on a GPU, `gpu_memory_utilization` of the device's memory (memory_stats()["bytes_limit"]) minus what is in
  use after the weights are loaded and the activations of the largest compiled step (XLA's memory analysis);
- else (CPU) what `max_num_seqs` sequences of `max_model_len` and 4 snapshot rows per sequence take, as before;
- `num_gpu_blocks_override` fixes the KV blocks instead, with `max_num_snapshots` (default 4 per sequence)
  snapshot rows capped by `snapshot_memory_bytes`.
"""
from __future__ import annotations

import functools
import logging

import jax

from cache import CacheConfig, CacheManager
from cache.device_buffers import CacheLayout, allocate_cache_buffers, num_state_rows
from cache.sizing import CacheSizes, plan_cache
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.model.cache_buffers import cache_layout
from qnext.model.tensor_parallel import sharded_buffers
from qnext.model.weights import as_dtype

logger = logging.getLogger("qnext.engine")

SNAPSHOTS_PER_SEQ = 4      # default snapshot rows per running sequence where no byte budget is given


def device_memory_stats() -> dict | None:
    """The first device's memory_stats() (GPUs report bytes_limit and bytes_in_use; CPUs report None)."""
    return jax.local_devices()[0].memory_stats()


def cache_sizes(cfg: ModelConfig, c: EngineConfig, max_model_len: int, activation_bytes=lambda: 0) -> CacheSizes:
    """The split of the cache budget. `activation_bytes()` is asked only on the GPU path (it compiles)."""
    layout = cache_layout(cfg, as_dtype(c.dtype))
    tp = c.tensor_parallel_size
    hybrid = bool(cfg.linear_layer_ids)
    kv_per_block = layout.kv_bytes_per_block(c.block_size) // tp     # per device: buffers are split by head
    row_bytes = layout.state_bytes_per_row // tp if hybrid else 0
    blocks_per_seq = -(-max_model_len // c.block_size)
    requested = c.max_num_snapshots
    if requested is None:
        requested = SNAPSHOTS_PER_SEQ * c.max_num_seqs if c.enable_prefix_caching else 0
    if not hybrid:
        requested = 0

    if c.num_gpu_blocks_override is not None:
        if c.num_gpu_blocks_override < blocks_per_seq:
            raise ValueError(f"num_gpu_blocks_override={c.num_gpu_blocks_override} blocks of {c.block_size} tokens "
                             f"cannot hold one sequence of max_model_len {max_model_len}")
        snapshots = requested
        if c.snapshot_memory_bytes is not None and row_bytes:
            snapshots = min(snapshots, c.snapshot_memory_bytes // row_bytes)
        state = (1 + c.max_num_seqs + snapshots) * row_bytes
        kv = (c.num_gpu_blocks_override + 1) * kv_per_block
        return CacheSizes(c.num_gpu_blocks_override, c.block_size, c.max_num_seqs, snapshots, kv, state, kv + state,
                          requested)

    stats = device_memory_stats() if c.kv_cache_memory_bytes is None else None
    if c.kv_cache_memory_bytes is not None:
        budget = c.kv_cache_memory_bytes
    elif stats and "bytes_limit" in stats:
        limit, in_use, activations = stats["bytes_limit"], stats.get("bytes_in_use", 0), activation_bytes()
        budget = int(c.gpu_memory_utilization * limit) - in_use - activations
        logger.info("cache budget %d bytes = %.2f x %d device bytes - %d in use (weights) - %d activations",
                    budget, c.gpu_memory_utilization, limit, in_use, activations)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={c.gpu_memory_utilization} of {limit} device bytes leaves "
                             f"nothing for the cache after {in_use} bytes in use and {activations} bytes of "
                             "activations; raise it or set kv_cache_memory_bytes")
    else:                                  # CPU: max_num_seqs full-length sequences and their snapshot rows
        budget = ((c.max_num_seqs * blocks_per_seq + 1) * kv_per_block
                  + (1 + c.max_num_seqs + requested) * row_bytes)
    fraction = c.snapshot_memory_fraction if c.enable_prefix_caching or c.max_num_snapshots else 0.0
    return plan_cache(budget, kv_bytes_per_block=kv_per_block, state_bytes_per_row=row_bytes,
                      block_size=c.block_size, max_num_seqs=c.max_num_seqs, max_model_len=max_model_len,
                      snapshot_memory_fraction=fraction, max_num_snapshots=requested,
                      snapshot_memory_bytes=c.snapshot_memory_bytes)


def make_cache(cfg: ModelConfig, c: EngineConfig, sizes: CacheSizes, mesh=None) -> CacheManager:
    """The cache manager, owning device buffers of `sizes` (sharded over `mesh` under tensor parallelism)."""
    cache = CacheManager(CacheConfig(block_size=c.block_size, num_blocks=sizes.num_blocks + 1,
                                     num_live_slots=sizes.num_live_rows, num_snapshot_slots=sizes.num_snapshot_rows,
                                     enable_prefix_caching=c.enable_prefix_caching,
                                     hybrid=bool(cfg.linear_layer_ids)))
    layout: CacheLayout = cache_layout(cfg, as_dtype(c.dtype))
    allocate = functools.partial(allocate_cache_buffers, layout, num_blocks=sizes.num_blocks + 1,
                                 block_size=c.block_size,
                                 num_state_rows=num_state_rows(sizes.num_live_rows, sizes.num_snapshot_rows))
    cache.attach_buffers(sharded_buffers(allocate, mesh) if mesh is not None else allocate())
    capped = sizes.max_num_snapshots is not None and sizes.num_snapshot_rows < sizes.max_num_snapshots
    (logger.warning if capped else logger.info)(sizes.describe())
    return cache
