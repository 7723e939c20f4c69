"""CacheManager: the engine-facing host bookkeeping for KV blocks, live state slots and mamba prefix snapshots.

Per step the engine calls: admit (new sequence) -> capture_positions / reserve_capture (prefill) or
decode_capture_row (decode, at a block boundary; decode_tracking_row before a multi-step call, decode_capture_row
after it for the boundary reached) -> append_slots (decode growth) -> [the step runs] ->
commit (publish what the step wrote) -> free (finish / abort / preempt). Nothing becomes matchable or restorable
before the commit of the step that wrote it. What is kept and evicted first is the policy's (cache/policy.py).
"""
import weakref
from typing import Hashable, Sequence

from cache.block_pool import BlockPool
from cache.config import CacheConfig
from cache.hashing import BlockHashFn, block_hashes, extend_block_hashes, hash_block_tokens
from cache.mamba_registry import MambaPrefixRegistry
from cache.records import Admission, SequenceRecord
from cache.policy import CachePolicy
from cache.snapshot_pool import SnapshotPool
from cache.stats import CacheStats

__all__ = ["Admission", "CacheConfig", "CacheManager"]

# why a snapshot was captured (SnapshotPool origin); branch points and checkpoints are shared by construction
PROMPT_END, CHECKPOINT, BRANCH, SEQUENCE_END = "prompt_end", "checkpoint", "branch", "sequence_end"


def _weak_method(method):
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class CacheManager:
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
        first = config.num_live_slots + 1
        self.snapshots = SnapshotPool(range(first, first + config.num_snapshot_slots),
                                      on_evict=_weak_method(self._on_snapshot_evicted))
        self._free_slots = list(range(config.num_live_slots, 0, -1))
        self._seqs: dict[Hashable, SequenceRecord] = {}

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
        if seq.ran:
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
    def admit(self, seq_id, prompt_token_ids: Sequence[int]) -> Admission | None:
        """None when no slot or not enough blocks: the cache is then left exactly as it was (retry later)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted; free it first")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"sequence {seq_id!r} has an empty prompt")
        if not self._free_slots:
            self.stats.admission_failures += 1
            return None
        bs = self.config.block_size
        hashes = block_hashes(prompt_token_ids, bs, self.block_hash_fn)
        matched: list[int] = []
        if self.config.enable_prefix_caching:  # the last prompt token is never served from cache
            matched = self.blocks.match(hashes[:(n - 1) // bs], prompt_token_ids, bs)
        depth = self._resolve(hashes, matched)
        num_fresh = -(-n // bs) - depth
        if not self.blocks.can_allocate(num_fresh, shared=matched[:depth]):
            self.stats.admission_failures += 1
            return None
        restore_row = None
        if depth and self.config.hybrid:
            restore_row = self.snapshots.row_of(hashes[depth - 1])
            self.snapshots.pin(restore_row)
        self.blocks.acquire(matched[:depth])
        fresh = self.blocks.allocate(num_fresh)
        seq = SequenceRecord(prompt_len=n, hashes=hashes, block_table=matched[:depth] + fresh,
                        state_row=self._free_slots.pop(), num_cached_tokens=depth * bs, chain=matched[:depth],
                        pinned_row=restore_row, kv_matched_tokens=len(matched) * bs)
        if restore_row is not None:
            seq.restored_hash = hashes[depth - 1]
            self._on_restore(seq.restored_hash)
        if len(matched) > depth:
            seq.branch_position = len(matched) * bs
        if self.uses_snapshots:
            seq.capture_plan = [p for p in self.policy.capture_positions(self.config, n, len(matched), depth)
                                if depth * bs < p <= n and not self._has_snapshot(hashes[p // bs - 1])]
        self._seqs[seq_id] = seq
        self._count_admission(seq, +1)
        self._track_peaks()
        return Admission(depth * bs, seq.block_table, seq.state_row, restore_row, len(matched) * bs)

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
        self.blocks.release(reversed(seq.block_table))
        self.blocks.release(self._twin_originals(seq))
        self._free_slots.append(seq.state_row)

    # ---- eviction and clearing --------------------------------------------------------------------------------------
    def evict_cached_blocks(self, num_blocks: int) -> list[int]:
        return self.blocks.evict(num_blocks)

    def evict_until_free(self, min_free: int) -> list[int]:
        return self.blocks.evict_until_free(min_free)

    def clear_prefix_cache(self) -> list[int]:
        evicted = self.blocks.clear_prefix_cache()
        for seq in self._seqs.values():
            self.blocks.release(self._twin_originals(seq))
            seq.chain = []
        return evicted

    # ---- policy mechanics -----------------------------------------------------------------------------------------
    def _resolve(self, hashes: list[bytes], matched: list[int]) -> int:
        if not self.config.hybrid:
            return len(matched)
        if not self.uses_snapshots:
            return 0
        return self.registry.resolve_mamba_matched_blocks(hashes[:len(matched)], matched, self.snapshots.__contains__)

    def _publish_limit(self, seq: SequenceRecord, num_computed_tokens: int, freeing: bool) -> int:
        tracked = seq.decode_position if seq.decode_row is not None else 0
        return self.policy.publish_limit(seq.prompt_len, num_computed_tokens, tracked, freeing)

    def _publish(self, seq: SequenceRecord, token_ids: Sequence[int], num_tokens: int) -> None:
        """Publish the sequence's full blocks below num_tokens in chain order, each new block once. A block whose
        prefix another block already caches stays private (a 'twin'); the sequence then holds that original until
        free, so its own later blocks always hang under a referenced chain. A hash that collides with another
        prefix's block stops publishing there."""
        if not self.config.enable_prefix_caching:
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
                cached = own
            elif cached != own:
                cached = self.blocks.cached_child(parent, block_hash, tokens)
                if cached is None:
                    return
                self.blocks.acquire([cached])
            seq.chain.append(cached)

    def _twin_originals(self, seq: SequenceRecord) -> list[int]:
        return [c for c, own in zip(seq.chain, seq.block_table) if c != own]

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
        if position == seq.branch_position:
            return BRANCH
        if position >= (seq.prompt_len - 1) // self.config.block_size * self.config.block_size:
            return PROMPT_END
        return CHECKPOINT

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
        if (restored is not None and self.snapshots.origin(restored) in (PROMPT_END, SEQUENCE_END)
                and self.snapshots.hits(restored) == 1):
            stale.append(restored)
        for prefix_hash in stale:
            self.snapshots.demote(prefix_hash)

    def _has_snapshot(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self.registry.valid_mamba_prefix_hashes and prefix_hash in self.snapshots

    def _on_kv_evicted(self, block_ids: list[int]) -> None:
        self.stats.kv_blocks_evicted += len(block_ids)
        for prefix_hash in self.registry.handle_mamba_prefix_evicted_blocks(block_ids):
            if self.snapshots.discard(prefix_hash):
                self.stats.snapshots_invalidated += 1
        self.policy.on_kv_evicted(block_ids)

    def _on_snapshot_evicted(self, prefix_hash: bytes) -> None:
        block = self.registry.mamba_prefix_block_by_hash.get(prefix_hash)
        self.registry.invalidate_mamba_prefix_hash(prefix_hash)
        if block is not None:
            self._sync_protection(block)
        self.stats.snapshots_evicted += 1

    def _sync_protection(self, block: int) -> None:
        if self.policy.protect_snapshot_blocks:
            self.blocks.set_protected(block, block in self.registry.mamba_prefix_hashes_by_block)

    # ---- internals ------------------------------------------------------------------------------------------------
    def _count_admission(self, seq: SequenceRecord, sign: int) -> None:
        s = self.stats
        s.admissions += sign
        s.prompt_tokens += sign * seq.prompt_len
        s.reused_tokens += sign * seq.num_cached_tokens
        s.kv_matched_tokens += sign * seq.kv_matched_tokens
        s.lost_to_missing_state_tokens += sign * (seq.kv_matched_tokens - seq.num_cached_tokens)
        s.snapshots_restored += sign * (seq.restored_hash is not None)

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
