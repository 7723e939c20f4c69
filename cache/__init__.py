"""Host-side cache manager: KV block pool + prefix cache, mamba snapshot registry and pool (no jax here)."""
from cache.block_pool import NULL_BLOCK, BlockPool
from cache.config import CacheConfig
from cache.hashing import block_hashes, hash_block_tokens
from cache.mamba_registry import MambaPrefixRegistry
from cache.manager import Admission, CacheManager
from cache.policy import CachePolicy
from cache.sizing import CacheSizes, plan_cache, snapshot_pool_capacity
from cache.snapshot_pool import SnapshotPool
from cache.stats import CacheStats

__all__ = ["NULL_BLOCK", "Admission", "BlockPool", "CacheConfig", "CacheManager", "CachePolicy", "CacheSizes",
           "CacheStats", "MambaPrefixRegistry", "SnapshotPool", "block_hashes", "hash_block_tokens", "plan_cache",
           "snapshot_pool_capacity"]
