"""The cache an engine starts with: its byte budget, the split of that budget into KV blocks, live state rows and
snapshot rows (cache/sizing.py's rule), the device buffers of those sizes (made in their shards under tensor
parallelism) and the host tier's arrays. engine/engine_cache.py's EngineCache builds the cache manager that owns
them from a `CacheSetup` and holds it for the scheduler and the engine.

The budget, in vLLM's terms:
- `kv_cache_memory_bytes` when given (the way to size the cache on CPU);
- else on a GPU, `gpu_memory_utilization` of the device's memory (memory_stats()["bytes_limit"]) minus what is in
  use after the weights are loaded and the activations of the largest compiled step (XLA's memory analysis);
- else (CPU) what `max_num_seqs` sequences of `max_model_len` and 4 snapshot rows per sequence take, as before;
- `num_gpu_blocks_override` fixes the KV blocks instead, with `max_num_snapshots` (default 4 per sequence)
  snapshot rows capped by `snapshot_memory_bytes`.
With a budget, the snapshot pool is sized by bytes (cache/sizing.py): `max_num_snapshots` None leaves the row count
to the budget's snapshot share; a number caps it.
The host tier (docs/cache.md): `kv_offloading_size` GiB of host RAM split like the device cache's KV blocks and
snapshot rows; with `prefix_cache_dir` and no such budget, as many blocks and rows as the device cache (a restart
loads the persisted cache there).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import functools
import logging

import jax

from cache import CacheConfig
from cache.device_buffers import CacheBuffers, CacheLayout, allocate_cache_buffers, num_state_rows
from cache.host_tier_buffers import HostTierBuffers, allocate_host_buffers
from cache.fingerprint import arrays_digest, cache_fingerprint
from cache.sizing import GIB, CacheSizes, plan_cache
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.model.cache_layout import cache_layout
from qnext.model.context_parallel_step import replicated
from qnext.model.tensor_parallel import sharded_buffers, sharded_model_config
from qnext.model.weights import as_dtype
from qnext.model.host_devices import engine_devices

logger = logging.getLogger("qnext.engine")

SNAPSHOTS_PER_SEQ = 4      # default snapshot rows per running sequence where no byte budget is given
# Float32 rows a step with a narrow snapshot pool (mamba_ssm_cache_dtype bfloat16) stages its captures inside
# segments in (qnext/model/snapshot_staging.py): the most such captures a step takes (a prompt's last block
# boundary, its branch point, turn starts and checkpoints). Each costs a live row (22.9 MiB at the flagship's TP8).
STAGING_ROWS = 16


@dataclasses.dataclass(frozen=True)
class CacheSetup:
    """What EngineCache builds its CacheManager from: the manager's config, the device buffers the manager takes
    ownership of, and the persisted cache to load into the host tier at start (prefix_cache_dir None: none)."""
    config: CacheConfig
    buffers: CacheBuffers
    prefix_cache_dir: str | None = None
    fingerprint: dict | None = None


def device_memory_stats() -> dict | None:
    """The first of this process's engine devices' memory_stats() (GPUs report bytes_limit and bytes_in_use; CPUs
    report None). Over several processes the others' devices cannot be asked."""
    local = [d for d in engine_devices() if d.process_index == jax.process_index()]
    return local[0].memory_stats() if local else None


def engine_cache_layout(cfg: ModelConfig, c: EngineConfig) -> CacheLayout:
    """The buffers' layout for the engine's options: model dtype, MTP KV layers, the cache's storage dtypes."""
    return cache_layout(cfg, as_dtype(c.dtype), c.num_mtp_kv_layers, c.kv_cache_dtype, c.mamba_ssm_cache_dtype)


def cache_sizes(cfg: ModelConfig, c: EngineConfig, max_model_len: int, activation_bytes=lambda: 0) -> CacheSizes:
    """The split of the cache budget. `activation_bytes()` is asked only on the GPU path (it compiles). Bytes are
    per device: under tensor parallelism each holds 1/tp of the heads (KV heads replicated where tp exceeds them)."""
    tp = c.tensor_parallel_size
    cfg = sharded_model_config(cfg, tp)
    layout = engine_cache_layout(cfg, c)
    hybrid = bool(cfg.linear_layer_ids)
    split = tp if cfg.attention_tensor_parallel else 1                # buffers split by head, or whole
    kv_per_block = layout.kv_bytes_per_block(c.block_size) // split     # per device
    row_bytes = layout.state_bytes_per_row // split if hybrid else 0
    narrow = hybrid and c.enable_prefix_caching and layout.narrow_snapshots     # a separate, narrow snapshot pool
    snapshot_row = layout.snapshot_bytes_per_row // split if narrow else row_bytes
    staging = STAGING_ROWS if narrow else 0
    blocks_per_seq = -(-max_model_len // c.block_size)
    requested = c.max_num_snapshots
    if requested is None:
        requested = SNAPSHOTS_PER_SEQ * c.max_num_seqs if c.enable_prefix_caching else 0
    if not hybrid:
        requested = 0
    row_cap = c.max_num_snapshots if hybrid and c.enable_prefix_caching else requested   # None: the bytes decide

    if c.num_gpu_blocks_override is not None:
        if c.num_gpu_blocks_override < blocks_per_seq:
            raise ValueError(f"num_gpu_blocks_override={c.num_gpu_blocks_override} blocks of {c.block_size} tokens "
                             f"cannot hold one sequence of max_model_len {max_model_len}")
        snapshots = requested
        if c.snapshot_memory_bytes is not None and row_bytes:
            snapshots = min(snapshots, c.snapshot_memory_bytes // snapshot_row)
        state = (1 + c.max_num_seqs + staging) * row_bytes + snapshots * snapshot_row
        kv = (c.num_gpu_blocks_override + 1) * kv_per_block
        return CacheSizes(c.num_gpu_blocks_override, c.block_size, c.max_num_seqs, snapshots, kv, state, kv + state,
                          requested, staging, snapshot_row if narrow else None)

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
                  + (1 + c.max_num_seqs + staging) * row_bytes + requested * snapshot_row)
    fraction = c.snapshot_memory_fraction if c.enable_prefix_caching or c.max_num_snapshots else 0.0
    return plan_cache(budget, kv_bytes_per_block=kv_per_block, state_bytes_per_row=row_bytes,
                      block_size=c.block_size, max_num_seqs=c.max_num_seqs, max_model_len=max_model_len,
                      snapshot_memory_fraction=fraction, max_num_snapshots=row_cap,
                      snapshot_memory_bytes=c.snapshot_memory_bytes,
                      snapshot_bytes_per_row=snapshot_row if narrow else None, num_staging_rows=staging)


def host_tier_sizes(cfg: ModelConfig, c: EngineConfig, sizes: CacheSizes) -> tuple[int, int]:
    """(host-tier KV blocks, host-tier snapshot slots). The host keeps whole (unsharded) blocks and rows."""
    if not c.enable_prefix_caching:
        return 0, 0
    layout = engine_cache_layout(sharded_model_config(cfg, c.tensor_parallel_size), c)
    block_bytes = layout.kv_bytes_per_block(c.block_size)
    row_bytes = layout.snapshot_bytes_per_row if cfg.linear_layer_ids else 0
    budget = int(c.kv_offloading_size * GIB)
    if budget:
        scale = budget / (sizes.num_blocks * block_bytes + sizes.num_snapshot_rows * row_bytes)
        return int(sizes.num_blocks * scale), int(sizes.num_snapshot_rows * scale) if row_bytes else 0
    if c.prefix_cache_dir is not None:
        return sizes.num_blocks, sizes.num_snapshot_rows if row_bytes else 0
    return 0, 0


def make_cache(cfg: ModelConfig, c: EngineConfig, sizes: CacheSizes, mesh=None,
               fingerprint: dict | None = None) -> tuple[CacheSetup, HostTierBuffers | None]:
    """The cache manager's setup, with device buffers of `sizes` (sharded over `mesh` under tensor parallelism),
    and the host tier's arrays (None without a host tier). With `prefix_cache_dir` (and its `fingerprint`) the
    setup names the cache file to load into the host tier."""
    host_blocks, host_snapshots = host_tier_sizes(cfg, c, sizes)
    staging = sizes.num_staging_rows if sizes.num_snapshot_rows else 0    # no snapshot rows: no pool to stage for
    cfg = sharded_model_config(cfg, c.tensor_parallel_size)      # the buffers hold the replicated heads too
    config = CacheConfig(block_size=c.block_size, num_blocks=sizes.num_blocks + 1, num_live_slots=sizes.num_live_rows,
                         num_snapshot_slots=sizes.num_snapshot_rows, enable_prefix_caching=c.enable_prefix_caching,
                         hybrid=bool(cfg.linear_layer_ids), num_host_blocks=host_blocks,
                         num_host_snapshot_slots=host_snapshots, num_staging_rows=staging)
    layout: CacheLayout = engine_cache_layout(cfg, c)
    if staging:     # the narrow pool: float32 rows for the zero, live and staging rows; the snapshots in the pool
        rows = dict(num_state_rows=num_state_rows(sizes.num_live_rows + staging, 0),
                    num_pool_rows=sizes.num_snapshot_rows, num_staging_rows=staging)
    else:
        rows = dict(num_state_rows=num_state_rows(sizes.num_live_rows, sizes.num_snapshot_rows))
    allocate = functools.partial(allocate_cache_buffers, layout, num_blocks=sizes.num_blocks + 1,
                                 block_size=c.block_size, **rows)
    # committed to the device, as the params and every step's outputs are (uncommitted, the first shape that runs
    # compiles again on its second call)
    if c.context_parallel_size > 1:          # whole on each device (qnext/model/context_parallel_step.py)
        buffers = replicated(allocate(), c.context_parallel_size)
    else:
        buffers = (sharded_buffers(allocate, mesh, cfg) if mesh is not None
                   else jax.device_put(allocate(), engine_devices()[0]))
    capped = sizes.max_num_snapshots is not None and sizes.num_snapshot_rows < sizes.max_num_snapshots
    (logger.warning if capped else logger.info)(sizes.describe())
    host = None
    if host_blocks or host_snapshots:
        host = allocate_host_buffers(layout, num_blocks=host_blocks, block_size=c.block_size,
                                     num_snapshots=host_snapshots)
        logger.info("host tier: %d KV blocks and %d snapshot rows (%.2f GiB of host RAM)", host_blocks,
                    host_snapshots, host.nbytes / GIB)
    if c.prefix_cache_dir is not None and host is not None and fingerprint is not None:
        return CacheSetup(config, buffers, c.prefix_cache_dir, fingerprint), host
    return CacheSetup(config, buffers), host


def prefix_cache_fingerprint(cfg: ModelConfig, c: EngineConfig, weights_digest: str) -> dict:
    """What a persisted cache is bound to (cache/fingerprint.py): the model config (its kernels' backends aside), the
    weights' digest, the dtype, the storage dtypes of KV and snapshots, the block size and the cache layout's version."""
    cfg = sharded_model_config(cfg, c.tensor_parallel_size)      # its buffers' layout (replicated heads)
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("backend", "gpu_kernels")}
    if c.num_mtp_kv_layers:                      # the blocks also hold the MTP head's KV
        config["mtp_kv_layers"] = c.num_mtp_kv_layers
    layout = engine_cache_layout(cfg, c)
    return cache_fingerprint(config, weights_digest, c.dtype, c.block_size, kv_dtype=layout.kv_storage,
                             snapshot_dtype=layout.snapshot_dtype)


# ModelConfig fields that say how the engine lays the model out, not what it computes
LAYOUT_FIELDS = ("backend", "gpu_kernels", "expert_parallel", "attention_tensor_parallel", "kv_cache_scale")


def model_identity_digest(cfg: ModelConfig, weights_digest: str, dtype: str, fp8_weights: str) -> str:
    """The model's identity (LLMEngine.model_identity): blake2b of its global config less LAYOUT_FIELDS, the weights'
    digest and the dtypes the engine computes in."""
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in LAYOUT_FIELDS}
    text = json.dumps({"config": config, "weights": weights_digest, "dtype": str(dtype), "fp8_weights": fp8_weights},
                      sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def params_weights_digest(params) -> str:
    """Digest of in-memory weights (fetched from the devices)."""
    return arrays_digest(jax.device_get(leaf) for leaf in jax.tree.leaves(params))
