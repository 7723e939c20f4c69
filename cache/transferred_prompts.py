"""A prompt computed elsewhere (prefill/decode disaggregation, docs/scale.md): the CacheManager's three calls for
it, as a mixin. hold_prefix pins the leading blocks this cache already holds (the transfer then brings only the
rest), admit_transferred admits the sequence with its prompt counted as computed, drop_held undoes a hold.
The manager's attributes they use: config, blocks, block_hash_fn, stats, _held, _seqs, _free_slots, _track_peaks."""
from __future__ import annotations

from typing import Sequence

from cache.hashing import block_hashes
from cache.records import Admission, SequenceRecord


class TransferredPrompts:
    def hold_prefix(self, seq_id, prompt_token_ids: Sequence[int]) -> int:
        """Keeps the cached device blocks that begin the prompt (chain hashes, confirmed by tokens; every full block,
        since the state comes with the transfer) until `admit_transferred` or `drop_held`. Returns how many: the
        blocks 0..k-1 need not be moved here."""
        if seq_id in self._held or seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already held or admitted")
        bs = self.config.block_size
        held: list[int] = []
        if self.config.enable_prefix_caching:
            hashes = block_hashes(prompt_token_ids, bs, self.block_hash_fn)
            held = self.blocks.match(hashes, prompt_token_ids, bs)
        self.blocks.acquire(held)
        self._held[seq_id] = held
        return len(held)

    def drop_held(self, seq_id) -> None:
        """Releases what hold_prefix kept (the transferred request was aborted before its admission)."""
        self.blocks.release(reversed(self._held.pop(seq_id, [])))

    def admit_transferred(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int) -> Admission | None:
        """Admits a sequence whose first num_computed_tokens tokens (the prompt) were computed elsewhere: the held
        blocks, fresh blocks for the rest (their KV, and the state after exactly num_computed_tokens tokens, are
        written into them and the live row before its first step: `Admission.block_table[held:]`, `state_row`).
        token_ids: the prompt and the first token sampled after it. None (the hold kept) when no slot or blocks."""
        held = self._held[seq_id]
        n, bs = len(token_ids), self.config.block_size
        if not 0 < num_computed_tokens < n:
            raise ValueError(f"a transferred sequence of {n} tokens must have 1..{n - 1} computed, "
                             f"not {num_computed_tokens}")
        num_fresh = -(-n // bs) - len(held)
        if not self._free_slots or not self.blocks.can_allocate(num_fresh):
            self.stats.admission_failures += 1
            return None
        del self._held[seq_id]
        state_row = self._free_slots.pop()
        seq = SequenceRecord(prompt_len=n, hashes=block_hashes(token_ids, bs, self.block_hash_fn),
                             block_table=held + self.blocks.allocate(num_fresh), state_row=state_row,
                             num_cached_tokens=num_computed_tokens, chain=list(held), restored_in_live_row=True,
                             kv_matched_tokens=num_computed_tokens,
                             transferred_tokens=num_computed_tokens - len(held) * bs)
        self._seqs[seq_id] = seq
        self.stats.count_admission(seq, +1)
        self._track_peaks()
        return Admission(num_computed_tokens, seq.block_table, state_row, state_row, num_computed_tokens)
