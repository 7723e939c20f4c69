"""Which admitted sequence a prompt waits for: the one that shares the most of its prefix and has not computed
(published) that much yet (CacheManager.sibling_prefix; docs/cache.md, "Waiting for a sibling")."""
from typing import Hashable, Sequence

from cache.records import SequenceRecord


def uncomputed_sibling(hashes: Sequence[bytes], seqs: dict[Hashable, SequenceRecord],
                       block_size: int) -> tuple[Hashable | None, int]:
    """(seq_id, shared blocks) of the admitted sequence whose prompt shares the longest block prefix with `hashes`
    beyond what it has published so far; (None, 0) if none does."""
    best_id, best = None, 0
    for seq_id, seq in seqs.items():
        shared = common_prefix(hashes, seq.hashes[:seq.prompt_len // block_size])
        if seq.cacheable and shared > max(best, len(seq.chain)):
            best_id, best = seq_id, shared
    return best_id, best


def common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
