"""The cache manager's snapshot mechanics, split out of manager.py: which snapshot a match can use, registering a
captured row, what a restore and a finish do to the snapshot LRU, and what eviction invalidates. Mixed into
`CacheManager` (cache/manager.py), which owns the state these methods read: config, policy, stats, blocks,
snapshots (the device pool), registry and tier (cache/tiers.py).
"""
from __future__ import annotations

from cache.host_blocks import HostBlock
from cache.records import SequenceRecord
from cache.tiers import host_terminal

# why a snapshot was captured (SnapshotPool origin); branch points and checkpoints are shared by construction
PROMPT_END, CHECKPOINT, BRANCH, SEQUENCE_END = "prompt_end", "checkpoint", "branch", "sequence_end"


class SnapshotLifecycle:
    def _resolve(self, hashes: list[bytes], matched: list[int], on_host: list[HostBlock]) -> int:
        """Depth of the match (device blocks, then host blocks) that the deepest resident snapshot can serve."""
        depth = len(matched) + len(on_host)
        if not self.config.hybrid:
            return depth
        if not self.uses_snapshots:
            return 0
        terminals = matched + [host_terminal(e.uid) for e in on_host]
        return self.registry.resolve_mamba_matched_blocks(hashes[:depth], terminals, self._snapshot_resident)

    def _register(self, seq: SequenceRecord, position: int, row: int) -> bool:
        """Register the reserved row as the snapshot at `position`; False (row released) if its KV is not cached."""
        depth = position // self.config.block_size
        if not self.uses_snapshots or depth > len(seq.chain):  # its KV is not cached: the state is useless
            self.snapshots.release(row)
            return False
        prefix_hash, terminal = seq.hashes[depth - 1], seq.chain[depth - 1]
        old = self.registry.mamba_prefix_block_by_hash.get(prefix_hash)
        self.registry.capture_mamba_prefix_state(prefix_hash, terminal)
        origin = self._origin(seq, position)
        self.snapshots.register(prefix_hash, row, self.policy.snapshot_priority(position, seq.prompt_len), origin)
        self.tier.snapshots.discard(prefix_hash)      # an older copy in the host tier
        self._sync_protection(terminal)
        if old is not None and old != terminal:
            self._sync_protection(old)
        self.stats.snapshots_captured += 1
        if origin in (PROMPT_END, CHECKPOINT):
            seq.prompt_snapshots.append(prefix_hash)
        return True

    def _origin(self, seq: SequenceRecord, position: int) -> str:
        if position > seq.prompt_len:
            return SEQUENCE_END
        if position >= (seq.prompt_len - 1) // self.config.block_size * self.config.block_size:
            return PROMPT_END         # also where the KV match ran to the prompt's end: nothing branched there
        if position == seq.branch_position:
            return BRANCH
        return CHECKPOINT

    def _snapshot_from_host(self, prefix_hash: bytes) -> int | None:
        """A snapshot row now holding a host-tier snapshot that earned it, which moves back to the pool with its
        origin and hits (loaded before the next step): a branch point, or one restored before. None otherwise, or
        if no row can be had: the caller loads it into the sequence's live row and it stays in the host tier (a
        one-off prompt end or finished turn should not push a pool snapshot out). Pinned in the host tier while a
        row is freed, so that the eviction cannot push it out."""
        host = self.tier.snapshots
        if host.hits(prefix_hash) == 0 and host.origin(prefix_hash) != BRANCH:
            return None
        host.pin(prefix_hash)
        row = self.snapshots.reserve()
        host.unpin(prefix_hash)
        if row is None:
            return None
        origin, hits = self.tier.snapshot_to_device(prefix_hash, row)
        self.snapshots.register(prefix_hash, row, 0, origin, hits)
        return row

    def _on_restore(self, prefix_hash: bytes) -> None:
        if self.policy.promote_on_restore:
            max_protected = int(self.config.num_snapshot_slots * self.policy.protected_share)
            self.snapshots.promote(prefix_hash, max_protected=max_protected)
        else:
            self.snapshots.touch(prefix_hash)

    def _on_superseded(self, seq: SequenceRecord) -> None:
        """A finished sequence registered a deeper snapshot on its own path, so the next turn continues from that
        one. Evicted first: its prompt snapshots nobody restored, and the snapshot it restored if that was a previous
        turn's prompt or sequence end used by this sequence alone. Branch points and checkpoints are shared by
        construction and keep their place."""
        if not self.policy.demote_superseded:
            return
        stale = [h for h in seq.prompt_snapshots if self.snapshots.hits(h) == 0]
        restored = seq.restored_hash
        for prefix_hash in stale:
            self.snapshots.demote(prefix_hash)
        held = self.tier.snapshots if seq.restored_in_live_row else self.snapshots   # where it was restored from
        if restored is not None and held.origin(restored) in (PROMPT_END, SEQUENCE_END) and held.hits(restored) == 1:
            held.demote(restored)

    def _has_snapshot(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self.registry.valid_mamba_prefix_hashes and self._snapshot_resident(prefix_hash)

    def _snapshot_resident(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self.snapshots or prefix_hash in self.tier.snapshots

    def _invalidate(self, terminals: list) -> None:
        """Blocks (device ids or host names) that left every tier: drop exactly the snapshots tied to them."""
        if not terminals:
            return
        for prefix_hash in self.registry.handle_mamba_prefix_evicted_blocks(terminals):
            if self.snapshots.discard(prefix_hash) | self.tier.snapshots.discard(prefix_hash):
                self.stats.snapshots_invalidated += 1

    def _on_snapshot_evicted(self, prefix_hash: bytes) -> None:
        """Called before the pool frees the row: its state moves to the host tier if it has one (still valid)."""
        self.stats.snapshots_evicted += 1
        pool = self.snapshots
        kept, dropped = self.tier.offload_snapshot(prefix_hash, pool.row_of(prefix_hash), pool.origin(prefix_hash),
                                                   pool.hits(prefix_hash))
        for lost in ([dropped] if kept else [prefix_hash]):
            if lost is not None:
                block = self.registry.mamba_prefix_block_by_hash.get(lost)
                self.registry.invalidate_mamba_prefix_hash(lost)
                if block is not None:
                    self._sync_protection(block)

    def _sync_protection(self, block) -> None:
        """Device leaves that end a snapshot's prefix are evicted last (host-tier names are ignored)."""
        if self.policy.protect_snapshot_blocks and isinstance(block, int):
            self.blocks.set_protected(block, block in self.registry.mamba_prefix_hashes_by_block)
