"""Which mamba prefix snapshots are usable, tied to the KV blocks they depend on (the seed's PR #231 semantics).

A snapshot is the recurrent + conv state after exactly k*block_size tokens, keyed by the chain hash of block k and
tied to that terminal KV block. KV eviction is leaf-first, so when block k goes every deeper block is already gone
and every shallower one is still cached: dropping the hashes tied to the evicted blocks invalidates exactly the
snapshots whose KV prefix became incomplete, and keeps the shallower ones usable.

With a host tier (cache/tiers.py) a terminal block is named by its device block id while on the device and by
`("host", uid)` while in the host tier; a block moving between tiers takes its snapshots along (`retie`), and only
a block that leaves every tier is reported to `handle_mamba_prefix_evicted_blocks`.
"""
from typing import Callable, Iterable, Sequence


class MambaPrefixRegistry:
    def __init__(self):
        self.mamba_prefix_hashes_by_block: dict[int, set[bytes]] = {}
        self.mamba_prefix_block_by_hash: dict[bytes, int] = {}
        self.valid_mamba_prefix_hashes: set[bytes] = set()

    def capture_mamba_prefix_state(self, prefix_hash: bytes, terminal_block: int) -> None:
        """Register a snapshot (after the step that wrote it ran); re-capturing a hash moves its association."""
        old_block = self.mamba_prefix_block_by_hash.get(prefix_hash)
        if old_block is not None and old_block != terminal_block:
            self._untie(prefix_hash, old_block)
        self.mamba_prefix_block_by_hash[prefix_hash] = terminal_block
        self.mamba_prefix_hashes_by_block.setdefault(terminal_block, set()).add(prefix_hash)
        self.valid_mamba_prefix_hashes.add(prefix_hash)

    def invalidate_mamba_prefix_hash(self, prefix_hash: bytes) -> bool:
        block = self.mamba_prefix_block_by_hash.pop(prefix_hash, None)
        if block is None:
            return False
        self._untie(prefix_hash, block)
        self.valid_mamba_prefix_hashes.discard(prefix_hash)
        return True

    def retie(self, old_block, new_block) -> None:
        """The block `old_block` now lives as `new_block` (it moved to another tier): its snapshots stay valid."""
        hashes = self.mamba_prefix_hashes_by_block.pop(old_block, None)
        if hashes:
            self.mamba_prefix_hashes_by_block.setdefault(new_block, set()).update(hashes)
            for prefix_hash in hashes:
                self.mamba_prefix_block_by_hash[prefix_hash] = new_block

    def handle_mamba_prefix_evicted_blocks(self, block_ids: Iterable[int]) -> list[bytes]:
        """Drop the snapshots tied to KV blocks that were evicted or cleared; returns their hashes."""
        dropped = []
        for block_id in block_ids:
            for prefix_hash in self.mamba_prefix_hashes_by_block.pop(block_id, ()):
                del self.mamba_prefix_block_by_hash[prefix_hash]
                self.valid_mamba_prefix_hashes.discard(prefix_hash)
                dropped.append(prefix_hash)
        return dropped

    def resolve_mamba_matched_blocks(self, hashes: Sequence[bytes], block_ids: Sequence[int],
                                     is_resident: Callable[[bytes], bool]) -> int:
        """Trim a KV match (hashes[i] cached as block_ids[i]) to the deepest depth whose snapshot is valid, tied to
        the matched terminal block and still resident. A valid hash whose snapshot is gone is invalidated."""
        for depth in range(len(hashes), 0, -1):
            prefix_hash = hashes[depth - 1]
            if prefix_hash not in self.valid_mamba_prefix_hashes:
                continue
            if self.mamba_prefix_block_by_hash[prefix_hash] == block_ids[depth - 1] and is_resident(prefix_hash):
                return depth
            self.invalidate_mamba_prefix_hash(prefix_hash)
        return 0

    def clear(self) -> list[bytes]:
        dropped = list(self.valid_mamba_prefix_hashes)
        self.mamba_prefix_hashes_by_block.clear()
        self.mamba_prefix_block_by_hash.clear()
        self.valid_mamba_prefix_hashes.clear()
        return dropped

    def _untie(self, prefix_hash: bytes, block: int) -> None:
        hashes = self.mamba_prefix_hashes_by_block.get(block)
        if hashes is not None:
            hashes.discard(prefix_hash)
            if not hashes:
                del self.mamba_prefix_hashes_by_block[block]
