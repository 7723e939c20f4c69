"""Host-side cache manager: KV block pool + prefix cache, mamba snapshot registry and pool, the host-RAM tier below
them, and the buffers they index (only the buffer modules import jax: device_buffers.py, buffer_copies.py,
host_tier_buffers.py, fork_buffer_copies.py; the bookkeeping modules do not)."""
from cache.block_pool import NULL_BLOCK, BlockPool
from cache.config import CacheConfig
from cache.hashing import block_hashes, hash_block_tokens
from cache.mamba_registry import MambaPrefixRegistry
from cache.manager import Admission, CacheManager
from cache.policy import CachePolicy
from cache.sizing import CacheSizes, plan_cache
from cache.snapshot_pool import SnapshotPool
from cache.stats import CacheStats, TierStats

__all__ = ["NULL_BLOCK", "Admission", "BlockPool", "CacheConfig", "CacheManager", "CachePolicy", "CacheSizes",
           "CacheStats", "MambaPrefixRegistry", "SnapshotPool", "TierStats", "block_hashes", "hash_block_tokens",
           "plan_cache"]
