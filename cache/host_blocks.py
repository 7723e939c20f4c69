"""KV blocks held in the host tier: what the device cache evicted, in host slots (plain Python, no jax).

An entry is keyed by its chain hash and identified by its uid, the identity a published block keeps while it moves
between tiers: an entry names its parent by uid, whether the parent is on the device or here. A hit is confirmed by
the parent's uid and the block's tokens, as on the device (a colliding hash under another prefix never matches).
Only leaves (entries with no child held here) are evicted, least recently used first, so the parent of every entry
is resident in some tier; when a block leaves every tier, `drop_subtree` drops the entries below it. Pinned
entries (an admission is about to load them) are never evicted.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Iterator, Sequence

from cache.free_list import FreeList


@dataclasses.dataclass(eq=False)
class HostBlock:
    uid: int
    hash: bytes
    parent_uid: int | None
    token_ids: tuple[int, ...]
    slot: int
    last_used: int = 0
    pinned: bool = False


class HostBlockStore:
    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"num_slots={num_slots} must be >= 0")
        self.num_slots = num_slots
        self._free = FreeList(range(num_slots))
        self._by_hash: dict[bytes, HostBlock] = {}
        self._by_uid: dict[int, HostBlock] = {}
        self._children: dict[int | None, set[int]] = {}    # parent uid -> uids of its children held here
        self._leaf_lru: list[tuple[int, int]] = []          # (last_used, uid) of leaves; stale items skipped
        self._clock = 0

    def __len__(self) -> int:
        return len(self._by_uid)

    def get(self, block_hash: bytes) -> HostBlock | None:
        return self._by_hash.get(block_hash)

    def by_uid(self, uid: int) -> HostBlock | None:
        return self._by_uid.get(uid)

    def entries(self) -> Iterator[HostBlock]:
        return iter(self._by_uid.values())

    def match(self, hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int, first: int,
              parent_uid: int | None) -> list[HostBlock]:
        """Entries continuing a chain from block index `first` under the block `parent_uid` (None: from the first
        block): hashes[first:], each confirmed by its parent and its tokens."""
        out: list[HostBlock] = []
        for i in range(first, len(hashes)):
            e = self._by_hash.get(hashes[i])
            if (e is None or e.parent_uid != parent_uid
                    or e.token_ids != tuple(token_ids[i * block_size:(i + 1) * block_size])):
                break
            out.append(e)
            parent_uid = e.uid
        return out

    def touch(self, entries: Sequence[HostBlock]) -> None:
        self._clock += 1
        for e in entries:
            e.last_used = self._clock
            self._push_if_leaf(e)

    def insert(self, uid: int, block_hash: bytes, parent_uid: int | None, token_ids: Sequence[int]
               ) -> tuple[HostBlock | None, list[HostBlock]]:
        """Hold a block whose parent is resident in some tier (the caller's contract), evicting least recently used
        unpinned leaves for room. Returns (the entry, or None when the hash is taken here or no room can be made;
        the evicted entries)."""
        if block_hash in self._by_hash or self.num_slots == 0:
            return None, []
        evicted = []
        while not self._free:
            victim = self.evict_lru()
            if victim is None:
                return None, evicted
            evicted.append(victim)
        self._clock += 1
        e = HostBlock(uid, block_hash, parent_uid, tuple(token_ids), self._free.take(), self._clock)
        self._by_hash[block_hash] = e
        self._by_uid[uid] = e
        self._children.setdefault(parent_uid, set()).add(uid)
        self._push_if_leaf(e)
        return e, evicted

    def remove(self, uid: int) -> HostBlock:
        """Take an entry out (it moved to the device, or the device holds the same block): its slot is free, and
        its children stay, under a parent that is now on the device."""
        e = self._by_uid.pop(uid)
        del self._by_hash[e.hash]
        self._free.put(e.slot)
        siblings = self._children[e.parent_uid]
        siblings.discard(uid)
        if not siblings:
            del self._children[e.parent_uid]
            parent = self._by_uid.get(e.parent_uid) if e.parent_uid is not None else None
            if parent is not None:
                self._push_if_leaf(parent)
        return e

    def drop_subtree(self, uid: int) -> list[HostBlock]:
        """Drop the entries below block `uid` (and `uid` itself if held here): it left every tier, so they can no
        longer be matched. Children first."""
        order, stack = [], [uid]
        while stack:
            u = stack.pop()
            if u in self._by_uid:
                order.append(u)
            stack.extend(self._children.get(u, ()))
        dropped = []
        for u in reversed(order):
            if self._by_uid[u].pinned:
                raise RuntimeError(f"host block {u} is pinned for a load but its parent left every tier")
            dropped.append(self.remove(u))
        return dropped

    def evict_lru(self) -> HostBlock | None:
        """Drop the least recently used unpinned leaf."""
        skipped, victim = [], None
        while self._leaf_lru:
            last_used, uid = heapq.heappop(self._leaf_lru)
            e = self._by_uid.get(uid)
            if e is None or e.last_used != last_used or uid in self._children:
                continue
            if e.pinned:
                skipped.append((last_used, uid))
                continue
            victim = self.remove(uid)
            break
        for item in skipped:
            heapq.heappush(self._leaf_lru, item)
        return victim

    def clear(self) -> list[HostBlock]:
        dropped = list(self._by_uid.values())
        self._free.reset()
        self._by_hash.clear()
        self._by_uid.clear()
        self._children.clear()
        self._leaf_lru.clear()
        return dropped

    def _push_if_leaf(self, e: HostBlock) -> None:
        if e.uid not in self._children:
            heapq.heappush(self._leaf_lru, (e.last_used, e.uid))
            if len(self._leaf_lru) > 4 * self.num_slots + 64:
                self._leaf_lru = [(x.last_used, x.uid) for x in self._by_uid.values() if x.uid not in self._children]
                heapq.heapify(self._leaf_lru)
