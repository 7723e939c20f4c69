"""A prompt computed elsewhere (prefill/decode disaggregation, docs/pd.md): the leading blocks this cache already
holds are kept (the transfer then brings only the rest) from the hold until the sequence's admission or the hold's
drop. An object the CacheManager holds (`manager.transferred`), with its own state (the holds); the manager's
admit_transferred gives the sequence its live row and takes its record."""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from cache.block_pool import BlockPool
from cache.config import CacheConfig
from cache.hashing import BlockHashFn, block_hashes
from cache.records import SequenceRecord


class TransferredPrompts:
    def __init__(self, config: CacheConfig, blocks: BlockPool, block_hash_fn: BlockHashFn,
                 admitted: Mapping[Hashable, SequenceRecord]):
        """admitted: the manager's admitted sequences (read only: an id there cannot be held)."""
        self.config, self.blocks, self.block_hash_fn, self._admitted = config, blocks, block_hash_fn, admitted
        self._held: dict[Hashable, list[int]] = {}     # sequence id -> the leading blocks kept for it

    def is_held(self, seq_id) -> bool:
        return seq_id in self._held

    def hold(self, seq_id, prompt_token_ids: Sequence[int]) -> int:
        """Keeps the cached device blocks that begin the prompt (chain hashes, confirmed by tokens; every full block,
        since the state comes with the transfer) until the sequence's admission or `drop`. Returns how many: blocks
        0..k-1 need not be moved here."""
        if seq_id in self._held or seq_id in self._admitted:
            raise ValueError(f"sequence {seq_id!r} is already held or admitted")
        bs = self.config.block_size
        held: list[int] = []
        if self.config.enable_prefix_caching:
            hashes = block_hashes(prompt_token_ids, bs, self.block_hash_fn)
            held = self.blocks.match(hashes, prompt_token_ids, bs)
        self.blocks.acquire(held)
        self._held[seq_id] = held
        return len(held)

    def drop(self, seq_id) -> None:
        """Releases what `hold` kept (the transferred request was aborted before its admission)."""
        self.blocks.release(reversed(self._held.pop(seq_id, [])))

    def num_fresh_blocks(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Blocks to allocate besides the held ones when the sequence is admitted. token_ids: the prompt and the
        first token sampled after it; num_computed_tokens: those computed elsewhere (the prompt)."""
        n = len(token_ids)
        if not 0 < num_computed_tokens < n:
            raise ValueError(f"a transferred sequence of {n} tokens must have 1..{n - 1} computed, "
                             f"not {num_computed_tokens}")
        return -(-n // self.config.block_size) - len(self._held[seq_id])

    def admit(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int, state_row: int) -> SequenceRecord:
        """The sequence's record: the held blocks, then fresh ones for the rest (the caller checked there are
        `num_fresh_blocks`); its first num_computed_tokens tokens count as computed, and the state after exactly
        that many is written into `state_row` before its first step. The hold ends here."""
        held, bs = self._held.pop(seq_id), self.config.block_size
        fresh = self.blocks.allocate(-(-len(token_ids) // bs) - len(held))
        return SequenceRecord(prompt_len=len(token_ids), hashes=block_hashes(token_ids, bs, self.block_hash_fn),
                              block_table=held + fresh, state_row=state_row, num_cached_tokens=num_computed_tokens,
                              chain=list(held), restored_in_live_row=True, kv_matched_tokens=num_computed_tokens,
                              transferred_tokens=num_computed_tokens - len(held) * bs)
