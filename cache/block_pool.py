"""KV block pool with a chained-hash prefix cache (plain Python, no jax).

Every usable block (ids 1..num_blocks-1; block 0 is the dummy that padding writes into) is in exactly one state:
- referenced: ref_count > 0, held by the block tables of running sequences (a cached block can be referenced too);
- cached: unreferenced but still published under its chain hash, so it stays matchable until it is evicted;
- free: unreferenced and unpublished.
Published blocks form a trie (each knows its parent block and its number of cached children). Only unreferenced
leaves are evicted, least recently used first, so the ancestors of a cached block are always cached: a prefix
match of depth k means blocks 1..k are all resident. A hit is confirmed by the block's tokens and its parent link,
so a hash collision can never splice another prefix's block into a chain. Leaves marked `protected` (the cache
manager marks the terminal blocks of mamba snapshots) go only when no unprotected leaf is left: for a hybrid model
a KV tail past the deepest snapshot cannot be reused without recomputing it, so it is cheaper to lose. Every
eviction path reports the evicted ids to `on_evict` (the cache manager invalidates the mamba snapshots tied to them).

Contract that makes `num_available` exact: a block is published only under a referenced parent, and a caller
releases a chain's blocks together (the cache manager holds every block of a sequence's published chain until
`free`). Then no unreferenced cached block has a referenced descendant, leaf eviction reaches every one of them,
and an allocation that cannot be served fails before it evicts anything.
"""
import heapq
from typing import Callable, Iterable, Sequence

from cache.free_list import FreeList

NULL_BLOCK = 0
NUM_PROTECTION_LEVELS = 3   # 0: evicted first; leaves of higher levels go only when no lower one is left


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent", "token_ids", "num_children", "last_used", "protected")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.parent: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.num_children = 0
        self.last_used = 0
        self.protected = 0


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[list[int]], None] | None = None,
                 max_cached_blocks: int | None = None):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the dummy block 0 plus at least one usable block")
        self.num_blocks = num_blocks
        self.on_evict = on_evict or (lambda block_ids: None)
        self.max_cached_blocks = max_cached_blocks
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free = FreeList(range(1, num_blocks), fifo=True)
        self._by_hash: dict[bytes, int] = {}
        # a heap of (last_used, block_id) per protection level; stale entries are skipped lazily
        self._leaf_lru: tuple[list[tuple[int, int]], ...] = tuple([] for _ in range(NUM_PROTECTION_LEVELS))
        self._clock = 0
        self._num_unreferenced_cached = 0

    # ---- counts -------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that are neither referenced nor cached."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    @property
    def num_available(self) -> int:
        """Free blocks plus unreferenced cached ones: exactly what allocation can reach (module contract)."""
        return len(self._free) + self._num_unreferenced_cached

    @property
    def num_used(self) -> int:
        """Referenced blocks."""
        return self.num_blocks - 1 - self.num_available

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def cached_block(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def block_hash(self, block_id: int) -> bytes | None:
        return self._blocks[block_id].hash

    def block_tokens(self, block_id: int) -> tuple[int, ...] | None:
        return self._blocks[block_id].token_ids

    def parent_of(self, block_id: int) -> int | None:
        return self._blocks[block_id].parent

    def last_used(self, block_id: int) -> int:
        """The pool's clock at the block's last use (larger: more recent)."""
        return self._blocks[block_id].last_used

    def is_free(self, block_id: int) -> bool:
        b = self._blocks[block_id]
        return b.ref_count == 0 and b.hash is None and block_id != NULL_BLOCK

    # ---- matching and references ----------------------------------------------------------------------------------
    def cached_child(self, parent: int | None, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block for `block_hash` if it continues `parent` (None: a first block) with exactly these tokens;
        None if the hash is not cached or collides with another prefix's block."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        b = self._blocks[block_id]
        if b.parent != parent or b.token_ids != tuple(token_ids):
            return None
        return block_id

    def match(self, hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int) -> list[int]:
        """Cached blocks for the longest prefix of `hashes` whose chain links and stored tokens match `token_ids`."""
        matched: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self.cached_child(matched[-1] if matched else None, h,
                                         token_ids[i * block_size:(i + 1) * block_size])
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def acquire(self, block_ids: Iterable[int]) -> None:
        """ref+1 on blocks a sequence starts sharing; refreshes their recency."""
        self._clock += 1
        for block_id in block_ids:
            b = self._blocks[block_id]
            if b.ref_count == 0:
                if b.hash is None:
                    raise ValueError(f"block {block_id} is free; only cached or referenced blocks can be shared")
                self._num_unreferenced_cached -= 1
            b.ref_count += 1
            b.last_used = self._clock

    def can_allocate(self, n: int, shared: Sequence[int] = ()) -> bool:
        """Whether n fresh blocks can be had after acquiring `shared` (cached blocks a new sequence will share)."""
        return n <= self.num_available - sum(1 for block_id in shared if self._blocks[block_id].ref_count == 0)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh unpublished blocks (ref 1), evicting LRU unreferenced leaves if needed; None, with nothing evicted
        or changed, if they cannot be had."""
        available = self.num_available
        if n > available:
            return None
        out: list[int] = []
        evicted: list[int] = []
        while len(out) < n:
            if self._free:
                block_id = self._free.take()
            else:
                block_id = self._evict_one()
                if block_id is None:
                    raise RuntimeError(f"num_available={available} but only {len(out)} of {n} "
                                       "blocks could be had: an unreferenced cached block has a referenced "
                                       "descendant (publish only under a referenced parent, release chains whole)")
                evicted.append(block_id)
            self._blocks[block_id].ref_count = 1
            out.append(block_id)
        if evicted:
            self.on_evict(evicted)
        return out

    def release(self, block_ids: Iterable[int]) -> None:
        """ref-1; a block reaching 0 stays cached (matchable) if published, else becomes free."""
        self._clock += 1
        for block_id in block_ids:
            b = self._blocks[block_id]
            if b.ref_count <= 0:
                raise ValueError(f"block {block_id} released more often than acquired")
            b.ref_count -= 1
            if b.ref_count:
                continue
            if b.hash is None:
                self._free.put(block_id)
            else:
                self._num_unreferenced_cached += 1
                b.last_used = self._clock
                if b.num_children == 0:
                    self._push_leaf(b)

    # ---- publishing -----------------------------------------------------------------------------------------------
    def publish(self, block_id: int, block_hash: bytes, parent: int | None, token_ids: Sequence[int]) -> bool:
        """Make a referenced, fully written block matchable as the child of `parent` (the cached block of the previous
        chain position; None for a first block). False if the hash is already cached (the block stays private). The
        parent must be cached and referenced (module contract). Trims the cache to max_cached_blocks afterwards."""
        if block_hash in self._by_hash:
            return False
        b = self._blocks[block_id]
        if b.ref_count == 0 or b.hash is not None:
            raise ValueError(f"block {block_id} must be referenced and unpublished to be published")
        if parent is not None:
            p = self._blocks[parent]
            if p.hash is None or p.ref_count == 0:
                raise ValueError(f"block {block_id}: parent block {parent} must be cached and referenced "
                                 f"(hash cached: {p.hash is not None}, ref_count {p.ref_count}); publish in chain "
                                 "order while holding the chain")
            p.num_children += 1
        b.hash, b.parent, b.token_ids = block_hash, parent, tuple(token_ids)
        self._clock += 1
        b.last_used = self._clock
        self._by_hash[block_hash] = block_id
        if self.max_cached_blocks is not None and len(self._by_hash) > self.max_cached_blocks:
            self.evict(len(self._by_hash) - self.max_cached_blocks)
        return True

    def set_protected(self, block_id: int, protected: int) -> None:
        """Evict this block only after every leaf of a lower protection level (0 .. NUM_PROTECTION_LEVELS - 1; the
        cache manager: 1 ends a snapshot's prefix, 2 ends a snapshot in the protected segment)."""
        b = self._blocks[block_id]
        if b.hash is None or b.protected == protected:
            return
        b.protected = protected
        if self._evictable(b):
            self._push_leaf(b)

    # ---- eviction paths (each reports to on_evict) ------------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Evict up to n unreferenced cached leaves, least recently used first; they become free."""
        evicted = []
        while len(evicted) < n:
            block_id = self._evict_one()
            if block_id is None:
                break
            evicted.append(block_id)
            self._free.put(block_id)
        if evicted:
            self.on_evict(evicted)
        return evicted

    def evict_until_free(self, min_free: int) -> list[int]:
        """Evict LRU unreferenced leaves until at least min_free blocks are free (or none is left): each eviction
        frees exactly one block."""
        return self.evict(max(0, min_free - len(self._free)))

    def clear_prefix_cache(self) -> list[int]:
        """Unpublish every cached block (referenced ones stay with their sequences as private blocks)."""
        evicted = list(self._by_hash.values())
        for block_id in evicted:
            b = self._blocks[block_id]
            b.hash = b.parent = b.token_ids = None
            b.num_children = 0
            b.protected = 0
            if b.ref_count == 0:
                self._free.put(block_id)
        self._by_hash.clear()
        for heap in self._leaf_lru:
            heap.clear()
        self._num_unreferenced_cached = 0
        if evicted:
            self.on_evict(evicted)
        return evicted

    # ---- internals ------------------------------------------------------------------------------------------------
    def _evictable(self, b: _Block) -> bool:
        return b.hash is not None and b.ref_count == 0 and b.num_children == 0

    def _push_leaf(self, b: _Block) -> None:
        heap = self._leaf_lru[b.protected]
        heapq.heappush(heap, (b.last_used, b.block_id))
        if len(heap) > 4 * self.num_blocks + 64:
            heap[:] = [(x.last_used, x.block_id) for x in self._blocks
                       if self._evictable(x) and x.protected == b.protected]
            heapq.heapify(heap)

    def _pop_leaf(self) -> _Block | None:
        for protected, heap in enumerate(self._leaf_lru):
            while heap:
                last_used, block_id = heapq.heappop(heap)
                b = self._blocks[block_id]
                if self._evictable(b) and b.last_used == last_used and b.protected == protected:
                    return b
        return None

    def _evict_one(self) -> int | None:
        """Unpublish the LRU unreferenced leaf; its parent may become an evictable leaf. Caller reports the id."""
        b = self._pop_leaf()
        if b is not None:
            block_id = b.block_id
            del self._by_hash[b.hash]
            if b.parent is not None:
                parent = self._blocks[b.parent]
                parent.num_children -= 1
                if self._evictable(parent):
                    self._push_leaf(parent)
            b.hash = b.parent = b.token_ids = None
            b.protected = 0
            self._num_unreferenced_cached -= 1
            return block_id
        return None
