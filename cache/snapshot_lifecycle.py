"""The snapshots' lifecycle, an object the cache manager holds: which snapshot a match can use, restoring one (from
the device pool or the host tier), registering a captured row, what a restore and a finish do to the snapshot LRU,
and what eviction invalidates. It owns the device's snapshot pool (cache/snapshot_pool.py) and works on the block
pool, the registry and the host tier that the manager shares with it.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

from cache.block_pool import BlockPool
from cache.config import CacheConfig
from cache.host_blocks import HostBlock
from cache.mamba_registry import MambaPrefixRegistry
from cache.policy import CachePolicy
from cache.records import SequenceRecord
from cache.snapshot_pool import SnapshotPool
from cache.stats import CacheStats
from cache.tiers import HostTier, host_terminal

# why a snapshot was captured (SnapshotPool origin); branch points and checkpoints are shared by construction
PROMPT_END, CHECKPOINT, BRANCH, SEQUENCE_END = "prompt_end", "checkpoint", "branch", "sequence_end"


def weak_method(method):
    """A callback that does not keep its object alive: the pools call back through these, so that no cycle holds
    the cache manager, which holds the device buffers (it must be freed by reference counting alone)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class SnapshotLifecycle:
    def __init__(self, config: CacheConfig, policy: CachePolicy, stats: CacheStats, blocks: BlockPool,
                 registry: MambaPrefixRegistry, tier: HostTier):
        self.config, self.policy, self.stats = config, policy, stats
        self.blocks, self.registry, self.tier = blocks, registry, tier
        first = config.first_snapshot_row
        self.pool = SnapshotPool(range(first, first + config.num_snapshot_slots),
                                 on_evict=weak_method(self._on_evicted), on_priority=weak_method(self._on_priority))

    @property
    def enabled(self) -> bool:
        c = self.config
        return c.hybrid and c.enable_prefix_caching and c.num_snapshot_slots > 0 and self.policy.snapshots_enabled

    def resolve(self, hashes: list[bytes], matched: list[int], on_host: list[HostBlock]) -> int:
        """Depth of the match (device blocks, then host blocks) that the deepest resident snapshot can serve."""
        depth = len(matched) + len(on_host)
        if not self.config.hybrid:
            return depth
        if not self.enabled:
            return 0
        terminals = matched + [host_terminal(e.uid) for e in on_host]
        return self.registry.resolve_mamba_matched_blocks(hashes[:depth], terminals, self._resident)

    def restore(self, prefix_hash: bytes, live_row: int) -> tuple[int | None, bool]:
        """Makes the snapshot readable by the sequence's first step: (its row, pinned until its first commit, or None
        when it is loaded into `live_row` instead; whether it came from the host tier)."""
        row = self.pool.row_of(prefix_hash)
        from_host = row is None
        if from_host:                       # held in the host tier: back into a snapshot row
            row = self._from_host(prefix_hash)
        if row is not None:
            self.pool.pin(row)
        else:                               # no row to be had: loaded into the live row, read from there
            self.tier.restore_snapshot(prefix_hash, live_row)
        return row, from_host

    def capture_plan(self, hashes: list[bytes], prompt_len: int, kv_matched_blocks: int, depth: int,
                     turn_starts: Sequence[int] = (), boundaries: Sequence[int] = ()) -> list[int]:
        """Where a new prompt captures snapshots: the policy's positions and the given block `boundaries` (those
        before each image), past the restored depth and not cached yet."""
        if not self.enabled:
            return []
        bs = self.config.block_size
        positions = set(self.policy.capture_positions(self.config, prompt_len, kv_matched_blocks, depth, turn_starts))
        return [p for p in sorted(positions.union(boundaries))
                if depth * bs < p <= prompt_len and not self._has_snapshot(hashes[p // bs - 1])]

    def committed(self, seq: SequenceRecord, limit: int) -> None:
        """After a step of the sequence: registers its captures at or below `limit` (the publish limit) and unpins
        its restore row (the step has read it)."""
        for position in sorted(p for p in seq.pending_captures if p <= limit):
            self._register(seq, position, seq.pending_captures.pop(position))
        self._unpin(seq)

    def freed(self, seq: SequenceRecord, limit: int) -> None:
        """At free: registers the captures whose step ran and the decode tracking snapshot (if its position was
        computed), releases the other reserved rows and unpins the restore row."""
        for position, row in sorted(seq.pending_captures.items()):
            if position <= limit:
                self._register(seq, position, row)
            else:
                self.pool.release(row)
        if seq.decode_row is not None:
            if not 0 < seq.decode_position <= limit:
                self.pool.release(seq.decode_row)
            elif self._register(seq, seq.decode_position, seq.decode_row):
                self._demote_superseded(seq)
                self._protect_continued(seq)
        self._unpin(seq)

    def origin(self, prefix_hash: bytes) -> str | None:
        """Why a resident snapshot was captured (device pool or host tier)."""
        return self.pool.origin(prefix_hash) or self.tier.snapshots.origin(prefix_hash)

    def on_restore(self, prefix_hash: bytes) -> None:
        if self.policy.promote_on_restore:
            self.pool.promote(prefix_hash, max_protected=self._max_protected)
        else:
            self.pool.touch(prefix_hash)

    @property
    def _max_protected(self) -> int:
        return int(self.config.num_snapshot_slots * self.policy.protected_share)

    def invalidate(self, terminals: list) -> None:
        """Blocks (device ids or host names) that left every tier: drop exactly the snapshots tied to them."""
        if not terminals:
            return
        for prefix_hash in self.registry.handle_mamba_prefix_evicted_blocks(terminals):
            if self.pool.discard(prefix_hash) | self.tier.snapshots.discard(prefix_hash):
                self.stats.snapshots_invalidated += 1

    def sync_protection(self, block) -> None:
        """Device leaves that end a snapshot's prefix are evicted after the others, and those ending a snapshot of
        the protected segment last: a KV tail is worth what its snapshot saves (host-tier names are ignored)."""
        if self.policy.protect_snapshot_blocks and isinstance(block, int):
            hashes = self.registry.mamba_prefix_hashes_by_block.get(block, ())
            self.blocks.set_protected(block, max((1 + (self.pool.priority(h) or 0) for h in hashes), default=0))

    # ---- internals ------------------------------------------------------------------------------------------------
    def _register(self, seq: SequenceRecord, position: int, row: int) -> bool:
        """Register the reserved row as the snapshot at `position`; False (row released) if its KV is not cached."""
        depth = position // self.config.block_size
        if not self.enabled or depth > len(seq.chain):  # its KV is not cached: the state is useless
            self.pool.release(row)
            return False
        prefix_hash, terminal = seq.hashes[depth - 1], seq.chain[depth - 1]
        old = self.registry.mamba_prefix_block_by_hash.get(prefix_hash)
        self.registry.capture_mamba_prefix_state(prefix_hash, terminal)
        origin = self._origin(seq, position)
        self.pool.register(prefix_hash, row, self.policy.snapshot_priority(position, seq.prompt_len), origin)
        self.tier.snapshots.discard(prefix_hash)      # an older copy in the host tier
        self.sync_protection(terminal)
        if old is not None and old != terminal:
            self.sync_protection(old)
        self.stats.snapshots_captured += 1
        if origin in (PROMPT_END, CHECKPOINT):
            seq.prompt_snapshots.append(prefix_hash)
        return True

    def _protect_continued(self, seq: SequenceRecord) -> None:
        """A sequence that continued a previous turn (it restored that turn's end, or matched its KV after its state
        was evicted: a conversation that came back) registers its own end in the protected segment: the
        conversation is likely to come back again, where a one-off question's end (it restored a shared prefix)
        starts on probation and goes first. A full segment drops its least recently used snapshot to probation, so
        ends of conversations that stopped give way (refusing newcomers instead kept more of a chat trace whose
        conversations outnumber the segment at 150k, 55% vs 52%, but froze the segment on a second pass over it:
        68% vs 89% at 300k)."""
        continued = seq.restored_origin == SEQUENCE_END or seq.kv_matched_tokens > seq.num_cached_tokens
        if self.policy.protect_continued and continued:
            self.pool.protect(seq.hashes[seq.decode_position // self.config.block_size - 1], self._max_protected)

    def _demote_superseded(self, seq: SequenceRecord) -> None:
        """A finished sequence registered a deeper snapshot on its own path, so the next turn continues from that
        one. Evicted first: its prompt snapshots nobody restored, and the snapshot it restored if that was a previous
        turn's prompt or sequence end used by this sequence alone. Branch points and checkpoints are shared by
        construction and keep their place."""
        if not self.policy.demote_superseded:
            return
        for prefix_hash in [h for h in seq.prompt_snapshots if self.pool.hits(h) == 0]:
            self.pool.demote(prefix_hash)
        restored = seq.restored_hash
        held = self.tier.snapshots if seq.restored_in_live_row else self.pool     # where it was restored from
        if restored is not None and held.origin(restored) in (PROMPT_END, SEQUENCE_END) and held.hits(restored) == 1:
            held.demote(restored)

    def _has_snapshot(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self.registry.valid_mamba_prefix_hashes and self._resident(prefix_hash)

    def _unpin(self, seq: SequenceRecord) -> None:
        if seq.pinned_row is not None:
            self.pool.unpin(seq.pinned_row)
            seq.pinned_row = None

    def _origin(self, seq: SequenceRecord, position: int) -> str:
        if position > seq.prompt_len:
            return SEQUENCE_END
        if position >= (seq.prompt_len - 1) // self.config.block_size * self.config.block_size:
            return PROMPT_END         # also where the KV match ran to the prompt's end: nothing branched there
        if position == seq.branch_position:
            return BRANCH
        return CHECKPOINT

    def _from_host(self, prefix_hash: bytes) -> int | None:
        """A snapshot row now holding a host-tier snapshot that earned it, which moves back to the pool with its
        origin and hits (loaded before the next step): a branch point, or one restored before. None otherwise, or
        if no row can be had: the caller loads it into the sequence's live row and it stays in the host tier (a
        one-off prompt end or finished turn should not push a pool snapshot out). Pinned in the host tier while a
        row is freed, so that the eviction cannot push it out."""
        host = self.tier.snapshots
        if host.hits(prefix_hash) == 0 and host.origin(prefix_hash) != BRANCH:
            return None
        host.pin(prefix_hash)
        row = self.pool.reserve()
        host.unpin(prefix_hash)
        if row is None:
            return None
        origin, hits = self.tier.snapshot_to_device(prefix_hash, row)
        self.pool.register(prefix_hash, row, 0, origin, hits)
        return row

    def _resident(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self.pool or prefix_hash in self.tier.snapshots

    def _on_priority(self, prefix_hash: bytes) -> None:
        block = self.registry.mamba_prefix_block_by_hash.get(prefix_hash)
        if block is not None:
            self.sync_protection(block)

    def _on_evicted(self, prefix_hash: bytes) -> None:
        """Called before the pool frees the row: its state moves to the host tier if it has one (still valid)."""
        self.stats.snapshots_evicted += 1
        pool = self.pool
        kept, dropped = self.tier.offload_snapshot(prefix_hash, pool.row_of(prefix_hash), pool.origin(prefix_hash),
                                                   pool.hits(prefix_hash))
        for lost in ([dropped] if kept else [prefix_hash]):
            if lost is not None:
                block = self.registry.mamba_prefix_block_by_hash.get(lost)
                self.registry.invalidate_mamba_prefix_hash(lost)
                if block is not None:
                    self.sync_protection(block)
