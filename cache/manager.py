"""CacheManager: the engine-facing host bookkeeping for KV blocks, live state slots and mamba prefix snapshots.

Per step the engine calls: admit (new sequence) -> capture_positions / reserve_capture (prefill) or
decode_capture_row (decode, at a block boundary; decode_tracking_row before a multi-step call, decode_capture_row
after it for the boundary reached) -> append_slots (decode growth) -> [the step runs] ->
commit (publish what the step wrote) -> free (finish / abort / preempt). Nothing becomes matchable or restorable
before the commit of the step that wrote it.
"""
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from cache.block_pool import BlockPool
from cache.hashing import block_hashes, extend_block_hashes
from cache.mamba_registry import MambaPrefixRegistry
from cache.snapshot_pool import SnapshotPool
from cache.stats import CacheStats


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int              # KV blocks including the reserved dummy block 0 (never handed out)
    num_live_slots: int          # live state rows are 1..num_live_slots (row 0 = dummy)
    num_snapshot_slots: int      # snapshot rows are num_live_slots+1 .. num_live_slots+num_snapshot_slots
    enable_prefix_caching: bool = True
    hybrid: bool = True          # False: plain transformer, reuse = KV match, no snapshots needed
    checkpoint_interval: int = 8192  # long prompts also capture at every multiple of this (floored to blocks; 0: off)

    def __post_init__(self):
        if self.block_size <= 0 or self.num_blocks < 2 or self.num_live_slots < 1 or self.num_snapshot_slots < 0:
            raise ValueError(f"{self}: need block_size > 0, num_blocks >= 2 (block 0 is the dummy), "
                             "num_live_slots >= 1, num_snapshot_slots >= 0")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval={self.checkpoint_interval} must be >= 0 (0 turns it off)")


@dataclass(frozen=True)
class Admission:
    num_cached_tokens: int       # tokens served from cache (a multiple of block_size, <= prompt_len - 1)
    block_table: list[int]       # blocks covering the whole prompt (shared cached ones first, then fresh)
    state_row: int               # the sequence's live state row
    restore_row: int | None      # snapshot row holding the state after num_cached_tokens tokens (None if 0 cached)
    kv_matched_tokens: int       # raw KV match before trimming to a usable snapshot (also <= prompt_len - 1)


@dataclass
class _Sequence:
    prompt_len: int
    hashes: list[bytes]                      # chain hashes of the full blocks known so far
    block_table: list[int]
    state_row: int
    num_cached_tokens: int
    capture_plan: list[int]
    pinned_row: int | None = None            # restore snapshot, pinned until the first commit
    pending_captures: dict[int, int] = field(default_factory=dict)  # position -> reserved row
    decode_row: int | None = None
    decode_position: int = 0
    publish_cursor: int = 0                  # blocks [0, cursor) are published (own or pinned under own children)
    branch_position: int = 0                 # where the KV match outran the state match (0: it did not)
    restored_hash: bytes | None = None
    kv_matched_tokens: int = 0
    ran: bool = False                        # a step committed for it (else free() takes back its admission counts)
    prompt_end_hashes: list[bytes] = field(default_factory=list)  # prompt-end snapshots this sequence registered


class CacheManager:
    protect_snapshot_blocks = True  # KV leaves ending a snapshot's prefix are evicted after all other leaves

    def __init__(self, config: CacheConfig):
        self.config = config
        self.stats = CacheStats()
        self.blocks = BlockPool(config.num_blocks, on_evict=self._on_kv_evicted)
        self.registry = MambaPrefixRegistry()
        first = config.num_live_slots + 1
        self.snapshots = SnapshotPool(range(first, first + config.num_snapshot_slots),
                                      on_evict=self._on_snapshot_evicted)
        self._free_slots = list(range(config.num_live_slots, 0, -1))
        self._seqs: dict[Hashable, _Sequence] = {}

    # ---- queries --------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: free plus unreferenced cached (evictable) ones."""
        return self.blocks.num_available

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def uses_snapshots(self) -> bool:
        c = self.config
        return c.hybrid and c.enable_prefix_caching and c.num_snapshot_slots > 0

    def block_table(self, seq_id) -> list[int]:
        return self._seq(seq_id).block_table

    def can_admit(self, prompt_len: int) -> bool:
        """Conservative: true if the prompt fits without any cache hit."""
        return bool(self._free_slots) and -(-prompt_len // self.config.block_size) <= self.blocks.num_available

    # ---- admission ------------------------------------------------------------------------------------------------
    def admit(self, seq_id, prompt_token_ids: Sequence[int]) -> Admission | None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted; free it first")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"sequence {seq_id!r} has an empty prompt")
        if not self._free_slots:
            self.stats.admission_failures += 1
            return None
        bs = self.config.block_size
        hashes = block_hashes(prompt_token_ids, bs)
        matched: list[int] = []
        if self.config.enable_prefix_caching:  # the last prompt token is never served from cache
            matched = self.blocks.match(hashes[:(n - 1) // bs], prompt_token_ids, bs)
        depth = self._resolve(hashes, matched)
        restore_row = None
        if depth and self.config.hybrid:  # pinned first: evictions below may drop the snapshot, never its row
            restore_row = self.snapshots.row_of(hashes[depth - 1])
            self.snapshots.pin(restore_row)
        self.blocks.acquire(matched[:depth])
        fresh = self.blocks.allocate(-(-n // bs) - depth)
        if fresh is None:
            self.blocks.release(matched[:depth])
            if restore_row is not None:
                self.snapshots.unpin(restore_row)
            self.stats.admission_failures += 1
            return None
        seq = _Sequence(prompt_len=n, hashes=hashes, block_table=matched[:depth] + fresh,
                        state_row=self._free_slots.pop(), num_cached_tokens=depth * bs, capture_plan=[],
                        pinned_row=restore_row)
        if restore_row is not None:
            seq.restored_hash = hashes[depth - 1]
            if seq.restored_hash in self.snapshots:
                self._on_restore(seq.restored_hash)
        if len(matched) > depth:
            seq.branch_position = len(matched) * bs
        if self.uses_snapshots:
            seq.capture_plan = [p for p in self._plan_captures(n, len(matched), depth)
                                if depth * bs < p <= n and not self._has_snapshot(hashes[p // bs - 1])]
        seq.kv_matched_tokens = len(matched) * bs
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
        """The decode tracking row, now holding (or about to hold) the state after `position` tokens."""
        seq = self._seq(seq_id)
        if position % self.config.block_size or position <= 0:
            raise ValueError(f"decode capture position {position} must be a positive multiple of "
                             f"{self.config.block_size}")
        if self.decode_tracking_row(seq_id) is not None:
            seq.decode_position = position
        return seq.decode_row

    def decode_tracking_row(self, seq_id) -> int | None:
        """The row a decoding sequence's block-boundary states go to (reserved on first use), without moving its
        recorded position: a multi-step call writes it only in the step that reaches a boundary, which the host
        learns afterwards, and then records with `decode_capture_row`."""
        seq = self._seq(seq_id)
        if seq.decode_row is None and self.uses_snapshots:
            seq.decode_row = self.snapshots.reserve()
            self._track_peaks()
        return seq.decode_row

    def append_slots(self, seq_id, num_tokens: int) -> bool:
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
        self._publish(seq, token_ids, num_computed_tokens)
        for position in sorted(p for p in seq.pending_captures if p <= num_computed_tokens):
            self._register(seq, position, seq.pending_captures.pop(position))
        self._unpin(seq)

    def free(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int, finished: bool) -> None:
        """Release a sequence. Published blocks stay matchable; reserved captures whose step ran and the decode
        tracking snapshot (if its position was computed) are registered, the other reserved rows freed. A preempted
        sequence's tracking snapshot is kept too: it is exact, and its re-admission will match it. Freeing a sequence
        no step ran for (admitted, then not scheduled) takes its admission out of the counters."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        if not seq.ran:
            self._count_admission(seq, -1)
        self._publish(seq, token_ids, num_computed_tokens)
        for position, row in sorted(seq.pending_captures.items()):
            if position <= num_computed_tokens:
                self._register(seq, position, row)
            else:
                self.snapshots.release(row)
        if seq.decode_row is not None:
            if 0 < seq.decode_position <= num_computed_tokens and self._register(seq, seq.decode_position,
                                                                                  seq.decode_row):
                self._on_superseded(seq)
            else:
                self.snapshots.release(seq.decode_row)
        self._unpin(seq)
        self.blocks.release(reversed(seq.block_table))
        self._free_slots.append(seq.state_row)

    # ---- eviction and clearing --------------------------------------------------------------------------------------
    def evict_cached_blocks(self, num_blocks: int) -> list[int]:
        return self.blocks.evict(num_blocks)

    def evict_until_free(self, min_free: int) -> list[int]:
        return self.blocks.evict_until_free(min_free)

    def clear_prefix_cache(self) -> list[int]:
        evicted = self.blocks.clear_prefix_cache()
        for seq in self._seqs.values():
            seq.publish_cursor = 0
        return evicted

    # ---- policy (subclasses in the benchmark model other engines by overriding these) -----------------------------
    def _plan_captures(self, prompt_len: int, kv_matched_blocks: int, restored_blocks: int) -> list[int]:
        """Last block boundary the same prompt can reuse (<= prompt_len - 1), the prompt end if it is a boundary
        (a longer prompt extending this one), the branch point where the KV match outran the state match, and
        sparse checkpoints along long prompts (requests that arrive before a branch point exists lose less)."""
        bs = self.config.block_size
        interval = self.config.checkpoint_interval // bs * bs
        positions = {(prompt_len - 1) // bs * bs}
        if interval:
            positions.update(range(interval, prompt_len, interval))
        if prompt_len % bs == 0:
            positions.add(prompt_len)
        if kv_matched_blocks > restored_blocks:
            positions.add(kv_matched_blocks * bs)
        return sorted(p for p in positions if p > 0)

    def _resolve(self, hashes: list[bytes], matched: list[int]) -> int:
        if not self.config.hybrid:
            return len(matched)
        return self.registry.resolve_mamba_matched_blocks(hashes[:len(matched)], matched, self.snapshots.__contains__)

    def _publish(self, seq: _Sequence, token_ids: Sequence[int], num_tokens: int) -> None:
        """Publish the sequence's full blocks below num_tokens in chain order. A block whose hash another block
        already caches stays private (a 'twin'); the cursor only passes it once a later block is published under it,
        since a cached block with cached children cannot be evicted."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = num_tokens // bs
        extend_block_hashes(seq.hashes, token_ids, bs, full)
        for i in range(seq.publish_cursor, full):
            h, own = seq.hashes[i], seq.block_table[i]
            cached = self.blocks.cached_block(h)
            if cached is None:
                self.blocks.publish(own, h, seq.hashes[i - 1] if i else None, token_ids[i * bs:(i + 1) * bs])
                seq.publish_cursor = i + 1
            elif cached == own:
                seq.publish_cursor = i + 1

    def _register(self, seq: _Sequence, position: int, row: int) -> bool:
        prefix_hash = seq.hashes[position // self.config.block_size - 1]
        terminal = self.blocks.cached_block(prefix_hash)
        if terminal is None:  # its KV is not cached (prefix caching off, or cleared): the state is useless
            self.snapshots.release(row)
            return False
        old = self.registry.mamba_prefix_block_by_hash.get(prefix_hash)
        self.registry.capture_mamba_prefix_state(prefix_hash, terminal)
        self.snapshots.register(prefix_hash, row, self._snapshot_priority(seq, position))
        self._sync_protection(terminal)
        if old is not None and old != terminal:
            self._sync_protection(old)
        self.stats.snapshots_captured += 1
        if position <= seq.prompt_len and position != seq.branch_position:
            seq.prompt_end_hashes.append(prefix_hash)
        return True

    def _snapshot_priority(self, seq: _Sequence, position: int) -> int:
        return 0  # probation until its first hit

    def _on_restore(self, prefix_hash: bytes) -> None:
        self.snapshots.promote(prefix_hash, max_protected=self.config.num_snapshot_slots * 3 // 4)

    def _on_superseded(self, seq: _Sequence) -> None:
        """A finished sequence registered a deeper snapshot on its own path: the next turn continues from that one,
        so its prompt-end snapshots, and the one it restored if nobody else used it, are evicted first."""
        stale = list(seq.prompt_end_hashes)
        if seq.restored_hash is not None and self.snapshots.hits(seq.restored_hash) == 1:
            stale.append(seq.restored_hash)
        for prefix_hash in stale:
            self.snapshots.demote(prefix_hash)

    def _has_snapshot(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self.registry.valid_mamba_prefix_hashes and prefix_hash in self.snapshots

    def _on_kv_evicted(self, block_ids: list[int]) -> None:
        self.stats.kv_blocks_evicted += len(block_ids)
        for prefix_hash in self.registry.handle_mamba_prefix_evicted_blocks(block_ids):
            if self.snapshots.discard(prefix_hash):
                self.stats.snapshots_invalidated += 1

    def _on_snapshot_evicted(self, prefix_hash: bytes) -> None:
        block = self.registry.mamba_prefix_block_by_hash.get(prefix_hash)
        self.registry.invalidate_mamba_prefix_hash(prefix_hash)
        if block is not None:
            self._sync_protection(block)
        self.stats.snapshots_evicted += 1

    def _sync_protection(self, block: int) -> None:
        if self.protect_snapshot_blocks:
            self.blocks.set_protected(block, block in self.registry.mamba_prefix_hashes_by_block)

    # ---- internals ------------------------------------------------------------------------------------------------
    def _count_admission(self, seq: _Sequence, sign: int) -> None:
        s = self.stats
        s.admissions += sign
        s.prompt_tokens += sign * seq.prompt_len
        s.reused_tokens += sign * seq.num_cached_tokens
        s.kv_matched_tokens += sign * seq.kv_matched_tokens
        s.lost_to_missing_state_tokens += sign * (seq.kv_matched_tokens - seq.num_cached_tokens)
        s.snapshots_restored += sign * (seq.restored_hash is not None)

    def _seq(self, seq_id) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not admitted")
        return seq

    def _unpin(self, seq: _Sequence) -> None:
        if seq.pinned_row is not None:
            self.snapshots.unpin(seq.pinned_row)
            seq.pinned_row = None

    def _track_peaks(self) -> None:
        s = self.stats
        s.peak_blocks_in_use = max(s.peak_blocks_in_use, self.blocks.num_used)
        s.peak_slots_in_use = max(s.peak_slots_in_use, self.config.num_live_slots - len(self._free_slots))
        s.peak_snapshot_rows_in_use = max(s.peak_snapshot_rows_in_use, self.snapshots.num_in_use)
