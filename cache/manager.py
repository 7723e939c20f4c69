"""CacheManager: the engine-facing host bookkeeping for KV blocks, live state slots and mamba prefix snapshots.

Per step the engine calls: admit (new sequence) -> capture_positions / reserve_capture (prefill) or
decode_capture_row (decode, at a block boundary; decode_tracking_row before a multi-step call, decode_capture_row
after it for the boundary reached) -> append_slots (decode growth) -> [the step runs] ->
commit (publish what the step wrote) -> free (finish / abort / preempt). Nothing becomes matchable or restorable
before the commit of the step that wrote it. What is kept and evicted first is the policy's (cache/policy.py).
With a host tier (config.num_host_blocks / num_host_snapshot_slots; cache/tiers.py) evictions are offloaded and a
match continues into the host tier; the copies this decides are taken with `take_transfers` before each step.
The snapshot mechanics live in cache/snapshot_lifecycle.py.
"""
import weakref
from typing import Hashable, Sequence

from cache.block_pool import BlockPool
from cache.forks import ForkCopies, ForkSupport
from cache.config import CacheConfig
from cache.hashing import BlockHashFn, block_hashes, extend_block_hashes, hash_block_tokens
from cache.host_blocks import HostBlock
from cache.mamba_registry import MambaPrefixRegistry
from cache.records import Admission, SequenceRecord
from cache.policy import CachePolicy
from cache.snapshot_lifecycle import SnapshotLifecycle
from cache.snapshot_pool import SnapshotPool
from cache.stats import CacheStats
from cache.tiers import HostTier
from cache.transfers import TransferPlan

__all__ = ["Admission", "CacheConfig", "CacheManager"]

def _weak_method(method):
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class CacheManager(SnapshotLifecycle, ForkSupport):
    _buffers = None                 # the device buffers between steps (attach_buffers)

    def __init__(self, config: CacheConfig, policy: CachePolicy | None = None,
                 block_hash_fn: BlockHashFn = hash_block_tokens):
        """block_hash_fn: the chain hash (tests inject a weak one to exercise collisions)."""
        self.config = config
        self.policy = policy or CachePolicy()
        self.block_hash_fn = block_hash_fn
        self.stats = CacheStats()
        # The pools call back through weak references: a manager must be freed by reference counting alone, since
        # it holds the device buffers (no cycle may keep them alive until a cyclic collection).
        self.blocks = BlockPool(config.num_blocks, on_evict=_weak_method(self._on_kv_evicted),
                                max_cached_blocks=self.policy.cached_block_limit(config.num_blocks - 1))
        self.registry = MambaPrefixRegistry()
        self.tier = HostTier(config.num_host_blocks, config.num_host_snapshot_slots, self.registry, self.stats.tiers)
        self._offload_evictions = True  # False while clearing: nothing cleared is kept in any tier
        first = config.num_live_slots + 1
        self.snapshots = SnapshotPool(range(first, first + config.num_snapshot_slots),
                                      on_evict=_weak_method(self._on_snapshot_evicted))
        self._free_slots = list(range(config.num_live_slots, 0, -1))
        self._seqs: dict[Hashable, SequenceRecord] = {}
        self._fork_copies = ForkCopies()     # queued by fork(), run before the next step (cache/forks.py)

    # ---- queries --------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: free plus unreferenced cached (evictable) ones; exact."""
        return self.blocks.num_available

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def uses_snapshots(self) -> bool:
        c = self.config
        return c.hybrid and c.enable_prefix_caching and c.num_snapshot_slots > 0 and self.policy.snapshots_enabled

    def block_table(self, seq_id) -> list[int]:
        return self._seq(seq_id).block_table

    def state_rows(self, seq_id) -> tuple[int, int]:
        """(read_row, write_row) of the sequence's next step: it starts from its restored snapshot (or the zero
        state, -1) until a step of it has been committed, then from its own live row, which it always writes."""
        seq = self._seq(seq_id)
        if seq.ran or seq.restored_in_live_row:
            return seq.state_row, seq.state_row
        return (-1 if seq.pinned_row is None else seq.pinned_row), seq.state_row

    # ---- the device buffers that the blocks and rows index ------------------------------------------------------
    def attach_buffers(self, buffers) -> None:
        """Takes ownership of the device buffers (cache/device_buffers.py) that this bookkeeping indexes."""
        self._buffers = buffers

    def lend_buffers(self):
        """Hands the buffers to a step, which donates them; until `return_buffers` gives the step's new ones
        back the manager holds none (a donated array must not be used again)."""
        if self._buffers is None:
            raise RuntimeError("the cache buffers are lent to a step that has not returned them")
        buffers, self._buffers = self._buffers, None
        return buffers

    def return_buffers(self, buffers) -> None:
        self._buffers = buffers

    @property
    def buffers(self):
        return self._buffers

    def can_admit(self, prompt_len: int) -> bool:
        """Conservative: true if the prompt fits without any cache hit."""
        return bool(self._free_slots) and -(-prompt_len // self.config.block_size) <= self.blocks.num_available

    # ---- admission ------------------------------------------------------------------------------------------------
    def admit(self, seq_id, prompt_token_ids: Sequence[int], num_forks: int = 0) -> Admission | None:
        """None when no slot or not enough blocks: the cache is then left exactly as it was (retry later).
        num_forks: live rows and blocks reserved for that many `fork`s after the prompt (cache/forks.py)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted; free it first")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"sequence {seq_id!r} has an empty prompt")
        fork_rows, fork_blocks = self._fork_needs(n, num_forks)
        if len(self._free_slots) < 1 + fork_rows:
            self.stats.admission_failures += 1
            return None
        bs = self.config.block_size
        hashes = block_hashes(prompt_token_ids, bs, self.block_hash_fn)
        matched: list[int] = []
        on_host: list[HostBlock] = []
        if self.config.enable_prefix_caching:  # the last prompt token is never served from cache
            limit = (n - 1) // bs
            matched = self.blocks.match(hashes[:limit], prompt_token_ids, bs)
            on_host = self.tier.match(hashes[:limit], prompt_token_ids, bs, matched)
        kv_matched = len(matched) + len(on_host)
        depth = self._resolve(hashes, matched, on_host)
        shared, loaded = matched[:depth], on_host[:max(0, depth - len(matched))]
        num_fresh = -(-n // bs) - len(shared)
        if not self.blocks.can_allocate(num_fresh + fork_blocks, shared=shared):
            self.stats.admission_failures += 1
            return None
        state_row = self._free_slots.pop()
        restore_row = restored_hash = None
        from_host = False
        if depth and self.config.hybrid:
            restored_hash = hashes[depth - 1]
            restore_row = self.snapshots.row_of(restored_hash)
            from_host = restore_row is None
            if from_host:                       # held in the host tier: back into a snapshot row
                restore_row = self._snapshot_from_host(restored_hash)
            if restore_row is not None:
                self.snapshots.pin(restore_row)
            else:                               # no row to be had: loaded into the live row, read from there
                self.tier.restore_snapshot(restored_hash, state_row)
        self.blocks.acquire(shared)
        self.tier.touch(on_host)
        self.tier.pin(loaded)                   # no eviction below may take them before they are loaded
        fresh = self.blocks.allocate(num_fresh)
        chain = shared + self._load_from_host(loaded, fresh[:len(loaded)], shared[-1] if shared else None)
        seq = SequenceRecord(prompt_len=n, hashes=hashes, block_table=chain + fresh[len(loaded):],
                             state_row=state_row, num_cached_tokens=depth * bs, chain=chain, pinned_row=restore_row,
                             kv_matched_tokens=kv_matched * bs, host_tokens=len(loaded) * bs,
                             restored_hash=restored_hash, snapshot_from_host=from_host,
                             restored_in_live_row=from_host and restore_row is None)
        if restore_row is not None:
            self._on_restore(restored_hash)
        if kv_matched > depth:
            seq.branch_position = kv_matched * bs
        if self.uses_snapshots:
            seq.capture_plan = [p for p in self.policy.capture_positions(self.config, n, kv_matched, depth)
                                if depth * bs < p <= n and not self._has_snapshot(hashes[p // bs - 1])]
        self._seqs[seq_id] = seq
        self._reserve_forks(seq, num_forks)
        self._count_admission(seq, +1)
        self._track_peaks()
        return Admission(depth * bs, seq.block_table, seq.state_row,
                         seq.state_row if seq.restored_in_live_row else restore_row, kv_matched * bs)

    def capture_positions(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).capture_plan)

    def reserve_capture(self, seq_id, position: int) -> int | None:
        seq = self._seq(seq_id)
        bs = self.config.block_size
        if position % bs or not seq.num_cached_tokens < position <= seq.prompt_len:
            raise ValueError(f"capture position {position} must be a multiple of {bs} in "
                             f"({seq.num_cached_tokens}, {seq.prompt_len}]")
        if position in seq.pending_captures:
            return seq.pending_captures[position]
        row = self.snapshots.reserve() if self.uses_snapshots else None
        if row is not None:
            seq.pending_captures[position] = row
            self._track_peaks()
        return row

    def decode_capture_row(self, seq_id, position: int) -> int | None:
        """The row that holds (or is about to hold) the state after `position` decoded tokens: the tracking row,
        or a row of its own under a policy that keeps every decode snapshot. None: no capture here."""
        seq = self._seq(seq_id)
        if position % self.config.block_size or position <= 0:
            raise ValueError(f"decode capture position {position} must be a positive multiple of "
                             f"{self.config.block_size}")
        if not self.policy.tracks_decode_boundary(position):
            return None
        if self.policy.keep_every_decode_snapshot:
            row = self.snapshots.reserve() if self.uses_snapshots else None
            if row is not None:
                seq.pending_captures[position] = row
            return row
        if self.decode_tracking_row(seq_id) is not None:
            seq.decode_position = position
        return seq.decode_row

    def decode_tracking_row(self, seq_id) -> int | None:
        """The row a decoding sequence's block-boundary states go to (reserved on first use), without moving its
        recorded position: a multi-step call writes it only in the step that reaches a boundary, which the host
        learns afterwards, and then records with `decode_capture_row`. The row is held for the sequence's life, so
        reserving it never evicts a snapshot that earned protection (None: no tracking, try again later)."""
        seq = self._seq(seq_id)
        if seq.decode_row is None and self.uses_snapshots:
            seq.decode_row = self.snapshots.reserve(may_evict_protected=False)
            self._track_peaks()
        return seq.decode_row

    def append_slots(self, seq_id, num_tokens: int) -> bool:
        """Blocks for the first num_tokens tokens; False (and nothing evicted or changed) if they cannot be had."""
        seq = self._seq(seq_id)
        need = -(-num_tokens // self.config.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        fresh = self.blocks.allocate(need)
        if fresh is None:
            return False
        seq.block_table.extend(fresh)
        self._track_peaks()
        return True

    # ---- after a step ---------------------------------------------------------------------------------------------
    def commit(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        seq = self._seq(seq_id)
        seq.ran = True
        limit = self._publish_limit(seq, num_computed_tokens, freeing=False)
        self._publish(seq, token_ids, limit)
        for position in sorted(p for p in seq.pending_captures if p <= limit):
            self._register(seq, position, seq.pending_captures.pop(position))
        self._unpin(seq)

    def free(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Release a sequence (finished, aborted or preempted alike). Published blocks stay matchable; reserved
        captures whose step ran and the decode tracking snapshot (if its position was computed) are registered, the
        other reserved rows freed: a preempted sequence's snapshots are exact and its re-admission matches them.
        Freeing a sequence no step ran for (admitted, then not scheduled) takes its admission out of the counters."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        if not seq.ran:
            self._count_admission(seq, -1)
        limit = self._publish_limit(seq, num_computed_tokens, freeing=True)
        self._publish(seq, token_ids, limit)
        for position, row in sorted(seq.pending_captures.items()):
            if position <= limit:
                self._register(seq, position, row)
            else:
                self.snapshots.release(row)
        if seq.decode_row is not None:
            if not 0 < seq.decode_position <= limit:
                self.snapshots.release(seq.decode_row)
            elif self._register(seq, seq.decode_position, seq.decode_row):
                self._on_superseded(seq)
        self._unpin(seq)
        self._release_forks(seq)
        self.blocks.release(reversed(seq.block_table))
        self.blocks.release(self._twin_originals(seq))
        self._free_slots.append(seq.state_row)

    # ---- eviction and clearing --------------------------------------------------------------------------------------
    def evict_cached_blocks(self, num_blocks: int) -> list[int]:
        return self.blocks.evict(num_blocks)

    def evict_until_free(self, min_free: int) -> list[int]:
        return self.blocks.evict_until_free(min_free)

    def clear_prefix_cache(self) -> list[int]:
        """Drops every cached block and snapshot in every tier (published blocks of running sequences stay theirs).
        Contract: a sequence admitted across a clear publishes nothing more (nor registers snapshots), and neither do
        its forks. Its KV predates the clear (a clear is for stale KV), and re-publishing its block table is unsound:
        past a twin, its own blocks hang under the twin's original, which others that share them hold, not its
        private twin; re-published under the twin, they would outlive their parent's references (num_available
        would count a block that eviction cannot reach)."""
        self._offload_evictions = False
        try:
            evicted = self.blocks.clear_prefix_cache()
        finally:
            self._offload_evictions = True
        self._invalidate(self.tier.clear())
        for seq in self._seqs.values():
            self.blocks.release(self._twin_originals(seq))
            seq.chain = []
            seq.cacheable = False
        return evicted

    def take_transfers(self) -> TransferPlan:
        """The copies between tiers decided since the last call, in order (cache/transfers.py); the scheduler runs
        them (cache/device_buffers.py) before it lends the buffers to the next step."""
        return self.tier.take_transfers()

    # ---- publishing, and the tiers ----------------------------------------------------------------------------
    def _load_from_host(self, entries: list[HostBlock], block_ids: list[int], parent: int | None) -> list[int]:
        """Publish fresh device blocks for host entries (their KV is loaded before the next step runs)."""
        for entry, block_id in zip(entries, block_ids):
            self.blocks.publish(block_id, entry.hash, parent, entry.token_ids)
            self.tier.moved_to_device(entry, block_id)
            self._sync_protection(block_id)
            parent = block_id
        return block_ids

    def _publish_limit(self, seq: SequenceRecord, num_computed_tokens: int, freeing: bool) -> int:
        tracked = seq.decode_position if seq.decode_row is not None else 0
        return self.policy.publish_limit(seq.prompt_len, num_computed_tokens, tracked, freeing)

    def _publish(self, seq: SequenceRecord, token_ids: Sequence[int], num_tokens: int) -> None:
        """Publish the sequence's full blocks below num_tokens in chain order, each new block once. A block whose
        prefix another block already caches stays private (a 'twin'); the sequence then holds that original until
        free, so its own later blocks always hang under a referenced chain. A hash that collides with another
        prefix's block stops publishing there."""
        if not self.config.enable_prefix_caching or not seq.cacheable:    # (see clear_prefix_cache)
            return
        bs = self.config.block_size
        full = num_tokens // bs
        extend_block_hashes(seq.hashes, token_ids, bs, full, self.block_hash_fn)
        for i in range(len(seq.chain), full):
            block_hash, own, tokens = seq.hashes[i], seq.block_table[i], token_ids[i * bs:(i + 1) * bs]
            parent = seq.chain[-1] if seq.chain else None
            cached = self.blocks.cached_block(block_hash)
            if cached is None:
                self.blocks.publish(own, block_hash, parent, tokens)
                self._invalidate(self.tier.published_on_device(own, block_hash, parent, tokens))
                self._sync_protection(own)              # it may have taken over the host copy's snapshots
                cached = own
            elif cached != own:
                cached = self.blocks.cached_child(parent, block_hash, tokens)
                if cached is None:
                    return
                self.blocks.acquire([cached])
            seq.chain.append(cached)

    def _twin_originals(self, seq: SequenceRecord) -> list[int]:
        return [c for c, own in zip(seq.chain, seq.block_table) if c != own]

    def _on_kv_evicted(self, block_ids: list[int]) -> None:
        """Device eviction (leaves first): offloaded to the host tier where it has room; what leaves the last tier
        invalidates the snapshots tied to it."""
        self.stats.kv_blocks_evicted += len(block_ids)
        self._invalidate(self.tier.evicted_from_device(block_ids, offload=self._offload_evictions))
        self.policy.on_kv_evicted(block_ids)

    # ---- internals ------------------------------------------------------------------------------------------------
    def _count_admission(self, seq: SequenceRecord, sign: int) -> None:
        s = self.stats
        s.admissions += sign
        s.prompt_tokens += sign * seq.prompt_len
        s.reused_tokens += sign * seq.num_cached_tokens
        s.kv_matched_tokens += sign * seq.kv_matched_tokens
        s.lost_to_missing_state_tokens += sign * (seq.kv_matched_tokens - seq.num_cached_tokens)
        s.snapshots_restored += sign * (seq.restored_hash is not None)
        s.tiers.device_hit_tokens += sign * (seq.num_cached_tokens - seq.host_tokens)
        s.tiers.host_hit_tokens += sign * seq.host_tokens
        s.tiers.host_hits += sign * bool(seq.host_tokens or seq.snapshot_from_host)

    def _seq(self, seq_id) -> SequenceRecord:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not admitted")
        return seq

    def _unpin(self, seq: SequenceRecord) -> None:
        if seq.pinned_row is not None:
            self.snapshots.unpin(seq.pinned_row)
            seq.pinned_row = None

    def _track_peaks(self) -> None:
        s = self.stats
        s.peak_blocks_in_use = max(s.peak_blocks_in_use, self.blocks.num_used)
        s.peak_slots_in_use = max(s.peak_slots_in_use, self.config.num_live_slots - len(self._free_slots))
        s.peak_snapshot_rows_in_use = max(s.peak_snapshot_rows_in_use, self.snapshots.num_in_use)
