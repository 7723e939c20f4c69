"""Publishing a sequence's KV blocks into the prefix cache, an object the cache manager holds: the full blocks a
step wrote, in chain order, and the blocks an admission loads back from the host tier (plain Python, no jax).

A block whose prefix another block already caches stays private (a "twin"); the sequence then holds that original
until free, so its own later blocks always hang under a referenced chain (cache/block_pool.py's contract). A hash
that collides with another prefix's block stops publishing there. Each publish tells the host tier (which may hold
the same block, or a colliding one) and the snapshots' lifecycle (snapshots tied to what left every tier, and which
leaves end a snapshot's prefix).
"""
from typing import Sequence

from cache.block_pool import BlockPool
from cache.config import CacheConfig
from cache.hashing import BlockHashFn, extend_block_hashes
from cache.host_blocks import HostBlock
from cache.policy import CachePolicy
from cache.records import SequenceRecord
from cache.snapshot_lifecycle import SnapshotLifecycle
from cache.tiers import HostTier


class Publisher:
    def __init__(self, config: CacheConfig, policy: CachePolicy, blocks: BlockPool, tier: HostTier,
                 lifecycle: SnapshotLifecycle, block_hash_fn: BlockHashFn):
        self.config, self.policy, self.blocks, self.tier = config, policy, blocks, tier
        self.lifecycle, self.block_hash_fn = lifecycle, block_hash_fn

    def limit(self, seq: SequenceRecord, num_computed_tokens: int, freeing: bool) -> int:
        """Tokens whose full blocks, and the snapshots at or below, are published now (the policy's rule)."""
        tracked = seq.decode_position if seq.decode_row is not None else 0
        return self.policy.publish_limit(seq.prompt_len, num_computed_tokens, tracked, freeing)

    def publish(self, seq: SequenceRecord, token_ids: Sequence[int], num_tokens: int) -> None:
        """Publish the sequence's full blocks below num_tokens in chain order, each new block once."""
        if not self.config.enable_prefix_caching or not seq.cacheable:    # (see CacheManager.clear_prefix_cache)
            return
        bs = self.config.block_size
        full = num_tokens // bs
        extend_block_hashes(seq.hashes, token_ids, bs, full, self.block_hash_fn, seq.images, seq.hash_root)
        for i in range(len(seq.chain), full):
            block_hash, own, tokens = seq.hashes[i], seq.block_table[i], token_ids[i * bs:(i + 1) * bs]
            parent = seq.chain[-1] if seq.chain else None
            cached = self.blocks.cached_block(block_hash)
            if cached is None:
                self.blocks.publish(own, block_hash, parent, tokens)
                self.lifecycle.invalidate(self.tier.published_on_device(own, block_hash, parent, tokens))
                self.lifecycle.sync_protection(own)              # it may have taken over the host copy's snapshots
                cached = own
            elif cached != own:
                cached = self.blocks.cached_child(parent, block_hash, tokens)
                if cached is None:
                    return
                self.blocks.acquire([cached])
            seq.chain.append(cached)

    def load_from_host(self, entries: list[HostBlock], block_ids: list[int], parent: int | None) -> list[int]:
        """Publish fresh device blocks for host entries (their KV is loaded before the next step runs)."""
        for entry, block_id in zip(entries, block_ids):
            self.blocks.publish(block_id, entry.hash, parent, entry.token_ids)
            self.tier.moved_to_device(entry, block_id)
            self.lifecycle.sync_protection(block_id)
            parent = block_id
        return block_ids
