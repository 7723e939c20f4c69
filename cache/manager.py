"""CacheManager: the engine-facing host bookkeeping for KV blocks, live state slots and mamba prefix snapshots.

Per step the engine calls: admit (new sequence) -> capture_positions / reserve_capture (prefill) or
decode_capture_row (decode, at a block boundary; decode_tracking_row before a multi-step call, decode_capture_row
after it for the boundary reached) -> append_slots (decode growth) -> [the step runs] ->
commit (publish what the step wrote) -> free (finish / abort / preempt). Nothing becomes matchable or restorable
before the commit of the step that wrote it. What is kept and evicted first is the policy's (cache/policy.py).
With a host tier (config.num_host_blocks / num_host_snapshot_slots; cache/tiers.py) evictions are offloaded and a
match continues into the host tier; the copies this decides are taken with `take_transfers` before each step.
The snapshots' lifecycle (cache/snapshot_lifecycle.py), the capture rows (cache/capture_rows.py), the forks
(cache/forks.py) and the holds of prompts computed elsewhere (cache/transferred_prompts.py) are objects it holds;
cache/siblings.py finds the sequence a prompt waits for.
"""
from typing import Hashable, Sequence

from cache.block_pool import BlockPool
from cache.capture_rows import CaptureRows
from cache.config import CacheConfig
from cache.forks import ForkCopies, Forks
from cache.hashing import BlockHashFn, block_hashes, hash_block_tokens
from cache.host_blocks import HostBlock
from cache.image_keys import ImageSpan, check_image_spans
from cache.mamba_registry import MambaPrefixRegistry
from cache.records import Admission, SequenceRecord
from cache.policy import CachePolicy
from cache.publishing import Publisher
from cache.siblings import uncomputed_sibling
from cache.snapshot_lifecycle import SnapshotLifecycle, weak_method
from cache.stats import CacheStats
from cache.tiers import HostTier
from cache.transferred_prompts import TransferredPrompts
from cache.transfers import TransferPlan

__all__ = ["Admission", "CacheConfig", "CacheManager"]


class CacheManager:
    _buffers = None                 # the device buffers between steps (attach_buffers)

    def __init__(self, config: CacheConfig, policy: CachePolicy | None = None,
                 block_hash_fn: BlockHashFn = hash_block_tokens):
        """block_hash_fn: the chain hash (tests inject a weak one to exercise collisions)."""
        self.config = config
        self.policy = policy or CachePolicy()
        self.block_hash_fn = block_hash_fn
        self.stats = CacheStats()
        self.blocks = BlockPool(config.num_blocks, on_evict=weak_method(self._on_kv_evicted),
                                max_cached_blocks=self.policy.cached_block_limit(config.num_blocks - 1))
        self.registry = MambaPrefixRegistry()
        self.tier = HostTier(config.num_host_blocks, config.num_host_snapshot_slots, self.registry, self.stats.tiers)
        self.lifecycle = SnapshotLifecycle(config, self.policy, self.stats, self.blocks, self.registry, self.tier)
        self.snapshots = self.lifecycle.pool
        self.publisher = Publisher(config, self.policy, self.blocks, self.tier, self.lifecycle, block_hash_fn)
        self.forks = Forks(config.block_size, self.blocks)
        self.captures = CaptureRows(config, self.policy, self.lifecycle)
        self._offload_evictions = True  # False while clearing: nothing cleared is kept in any tier
        self._free_slots = list(range(config.num_live_slots, 0, -1))
        self._seqs: dict[Hashable, SequenceRecord] = {}
        self.transferred = TransferredPrompts(config, self.blocks, block_hash_fn, admitted=self._seqs)

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
        return self.lifecycle.enabled

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

    # ---- admission ------------------------------------------------------------------------------------------------
    def admit(self, seq_id, prompt_token_ids: Sequence[int], num_forks: int = 0,
              turn_starts: Sequence[int] = (), images: Sequence[ImageSpan] = (),
              hash_root: bytes | None = None) -> Admission | None:
        """None when no slot or not enough blocks: the cache is then left exactly as it was (retry later).
        num_forks: live rows and blocks reserved for that many `fork`s after the prompt (cache/forks.py).
        turn_starts: where the prompt's chat turns begin (positions of `<|im_start|>`), for the capture policy.
        images: the prompt's image spans: their blocks key on the images (cache/image_keys.py), and a snapshot is
        planned at the boundary at or before each `<|vision_start|>` (the token before a span).
        hash_root: the root of its block hash chain (a LoRA adapter's digest: cache/hashing.py)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted; free it first")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"sequence {seq_id!r} has an empty prompt")
        fork_rows, fork_blocks = self.forks.needs(n, num_forks)
        if len(self._free_slots) < 1 + fork_rows:
            self.stats.admission_failures += 1
            return None
        bs = self.config.block_size
        images = check_image_spans(images, n)
        hashes = block_hashes(prompt_token_ids, bs, self.block_hash_fn, images, hash_root)
        matched: list[int] = []
        on_host: list[HostBlock] = []
        if self.config.enable_prefix_caching:  # the last prompt token is never served from cache
            limit = (n - 1) // bs
            matched = self.blocks.match(hashes[:limit], prompt_token_ids, bs)
            on_host = self.tier.match(hashes[:limit], prompt_token_ids, bs, matched)
        kv_matched = len(matched) + len(on_host)
        depth = self.lifecycle.resolve(hashes, matched, on_host)
        shared, loaded = matched[:depth], on_host[:max(0, depth - len(matched))]
        num_fresh = -(-n // bs) - len(shared)
        if not self.blocks.can_allocate(num_fresh + fork_blocks, shared=shared):
            self.stats.admission_failures += 1
            return None
        state_row = self._free_slots.pop()
        restore_row = restored_hash = None
        from_host = False
        restored_origin = None
        if depth and self.config.hybrid:
            restored_hash = hashes[depth - 1]
            restored_origin = self.lifecycle.origin(restored_hash)
            restore_row, from_host = self.lifecycle.restore(restored_hash, state_row)
        self.blocks.acquire(shared)
        self.tier.touch(on_host)
        self.tier.pin(loaded)                   # no eviction below may take them before they are loaded
        fresh = self.blocks.allocate(num_fresh)
        chain = shared + self.publisher.load_from_host(loaded, fresh[:len(loaded)], shared[-1] if shared else None)
        seq = SequenceRecord(prompt_len=n, hashes=hashes, block_table=chain + fresh[len(loaded):],
                             state_row=state_row, num_cached_tokens=depth * bs, chain=chain, pinned_row=restore_row,
                             kv_matched_tokens=kv_matched * bs, host_tokens=len(loaded) * bs,
                             restored_hash=restored_hash, restored_origin=restored_origin, hash_root=hash_root,
                             snapshot_from_host=from_host,
                             restored_in_live_row=from_host and restore_row is None, images=images)
        if restore_row is not None:
            self.lifecycle.on_restore(restored_hash)
        if kv_matched > depth:
            seq.branch_position = kv_matched * bs
        vision_starts = [max(0, span.start - 1) // bs * bs for span in images]
        seq.capture_plan = self.lifecycle.capture_plan(hashes, n, kv_matched, depth, turn_starts, vision_starts)
        self._seqs[seq_id] = seq
        self.forks.reserve(seq, [self._free_slots.pop() for _ in range(fork_rows)])
        self.stats.count_admission(seq, +1)
        self._track_peaks()
        return Admission(depth * bs, seq.block_table, seq.state_row,
                         seq.state_row if seq.restored_in_live_row else restore_row, kv_matched * bs)

    def sibling_prefix(self, prompt_token_ids: Sequence[int], images: Sequence[ImageSpan] = (),
                       hash_root: bytes | None = None) -> tuple | None:
        """(seq_id, tokens) of an admitted sequence that shares more of this prompt than the cache serves now, by at
        least the policy's `sibling_wait_tokens`, and has not computed that shared prefix yet; that sequence now
        also captures a snapshot where the prompts part. A scheduler holds the prompt back while this answers (the
        sibling computes the prefix once, then the prompt restores at the branch point) and admits it once it is
        None: the sibling published the prefix, finished or was preempted."""
        wait = self.policy.sibling_wait_tokens
        if wait <= 0 or not self.config.enable_prefix_caching or not self._seqs or \
                (self.config.hybrid and not self.uses_snapshots):   # without snapshots waiting reuses nothing
            return None
        bs, n = self.config.block_size, len(prompt_token_ids)
        limit = (n - 1) // bs
        hashes = block_hashes(prompt_token_ids[:limit * bs], bs, self.block_hash_fn, check_image_spans(images, n),
                              hash_root)
        best_id, best = uncomputed_sibling(hashes, self._seqs, bs)
        if best_id is None:
            return None
        matched = self.blocks.match(hashes, prompt_token_ids, bs)
        served = self.lifecycle.resolve(hashes, matched, self.tier.match(hashes, prompt_token_ids, bs, matched))
        if (best - served) * bs < wait:
            return None
        sibling = self._seqs[best_id]
        if self.policy.capture_for_sibling and self.uses_snapshots and best * bs not in sibling.capture_plan:
            sibling.capture_plan = sorted([*sibling.capture_plan, best * bs])
        return best_id, best * bs

    def capture_positions(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).capture_plan)

    def reserve_capture(self, seq_id, position: int) -> int | None:
        row = self.captures.reserve(self._seq(seq_id), position)
        self._track_peaks()
        return row

    def decode_capture_row(self, seq_id, position: int) -> int | None:
        """The row that holds (or is about to hold) the state after `position` decoded tokens (CaptureRows)."""
        row = self.captures.decode_row(self._seq(seq_id), position)
        self._track_peaks()
        return row

    def decode_tracking_row(self, seq_id) -> int | None:
        """The row a decoding sequence's block-boundary states go to, its position not moved (CaptureRows)."""
        row = self.captures.tracking_row(self._seq(seq_id))
        self._track_peaks()
        return row

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

    def fork(self, parent_id, child_id) -> None:
        """Makes `child_id` a copy of `parent_id` after its whole prompt (call after the commit of the step that
        computed the prompt's last token), from the reserves taken at the parent's admission (cache/forks.py)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already admitted")
        if not parent.fork_rows:
            raise ValueError(f"sequence {parent_id!r} has no fork reserved (admit it with num_forks)")
        self._seqs[child_id] = self.forks.fork(parent)
        self._track_peaks()

    def take_fork_copies(self) -> ForkCopies:
        """The fork copies queued since the last call; the scheduler runs them first whenever it lends the buffers."""
        return self.forks.take_copies()

    # ---- after a step ---------------------------------------------------------------------------------------------
    def commit(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        seq = self._seq(seq_id)
        seq.ran = True
        limit = self.publisher.limit(seq, num_computed_tokens, freeing=False)
        self.publisher.publish(seq, token_ids, limit)
        self.lifecycle.committed(seq, limit)

    def free(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Release a sequence (finished, aborted or preempted alike). Published blocks stay matchable; reserved
        captures whose step ran and the decode tracking snapshot (if its position was computed) are registered, the
        other reserved rows freed: a preempted sequence's snapshots are exact and its re-admission matches them.
        Freeing a sequence no step ran for (admitted, then not scheduled) takes its admission out of the counters."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        if not seq.ran:
            self.stats.count_admission(seq, -1)
        limit = self.publisher.limit(seq, num_computed_tokens, freeing=True)
        self.publisher.publish(seq, token_ids, limit)
        self.lifecycle.freed(seq, limit)
        self._free_slots.extend(self.forks.release(seq))
        self.blocks.release(reversed(seq.block_table))
        self.blocks.release(self._twin_originals(seq))
        self._free_slots.append(seq.state_row)

    # ---- a prompt computed elsewhere, held by `transferred` (cache/transferred_prompts.py), admitted here ----------
    def admit_transferred(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int) -> Admission | None:
        """None (the hold kept) when no live row or not enough blocks."""
        num_fresh = self.transferred.num_fresh_blocks(seq_id, token_ids, num_computed_tokens)
        if not self._free_slots or not self.blocks.can_allocate(num_fresh):
            self.stats.admission_failures += 1
            return None
        seq = self._seqs[seq_id] = self.transferred.admit(seq_id, token_ids, num_computed_tokens,
                                                         self._free_slots.pop())
        self.stats.count_admission(seq, +1)
        self._track_peaks()
        return Admission(num_computed_tokens, seq.block_table, seq.state_row, seq.state_row, num_computed_tokens)

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
        self.lifecycle.invalidate(self.tier.clear())
        for seq in self._seqs.values():
            self.blocks.release(self._twin_originals(seq))
            seq.chain = []
            seq.cacheable = False
        return evicted

    def take_transfers(self) -> TransferPlan:
        """The copies between tiers decided since the last call, in order (cache/transfers.py); the scheduler runs
        them (cache/host_tier_buffers.py) before it lends the buffers to the next step."""
        return self.tier.take_transfers()

    # ---- internals ------------------------------------------------------------------------------------------------
    def _twin_originals(self, seq: SequenceRecord) -> list[int]:
        return [c for c, own in zip(seq.chain, seq.block_table) if c != own]

    def _on_kv_evicted(self, block_ids: list[int]) -> None:
        """Device eviction (leaves first): offloaded to the host tier where it has room; what leaves the last tier
        invalidates the snapshots tied to it."""
        self.stats.kv_blocks_evicted += len(block_ids)
        self.lifecycle.invalidate(self.tier.evicted_from_device(block_ids, offload=self._offload_evictions))
        self.policy.on_kv_evicted(block_ids)

    def _seq(self, seq_id) -> SequenceRecord:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not admitted")
        return seq

    def _track_peaks(self) -> None:
        self.stats.track_peaks(self.blocks.num_used, self.config.num_live_slots - len(self._free_slots),
                               self.snapshots.num_in_use)

