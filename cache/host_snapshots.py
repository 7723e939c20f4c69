"""Snapshots held in the host tier: state rows the device's snapshot pool evicted, by prefix hash, in host slots,
under one LRU (plain Python, no jax). Each keeps the origin and hit count it had in the pool (the manager's
demotion rule reads them, cache/snapshot_lifecycle.py). Which of them are valid is the registry's business
(cache/mamba_registry.py): the cache manager discards a snapshot here when its terminal KV block leaves every tier."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from cache.free_list import FreeList


class HostSnapshotStore:
    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"num_slots={num_slots} must be >= 0")
        self.num_slots = num_slots
        self._free = FreeList(range(num_slots))
        self._lru: OrderedDict[bytes, int] = OrderedDict()     # prefix hash -> slot, least recently used first
        self._origin: dict[bytes, str] = {}
        self._hits: dict[bytes, int] = {}
        self._pinned: set[bytes] = set()      # being loaded back: not evicted, slot kept

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self._lru

    def slot_of(self, prefix_hash: bytes) -> int | None:
        return self._lru.get(prefix_hash)

    def items(self) -> Iterator[tuple[bytes, int]]:
        """(prefix hash, slot), least recently used first."""
        return iter(list(self._lru.items()))

    def insert(self, prefix_hash: bytes, origin: str = "", hits: int = 0) -> tuple[int | None, bytes | None]:
        """A slot for a new snapshot (most recently used), evicting the least recently used unpinned one if full.
        Returns (slot, or None when no slot can be had; the evicted prefix hash or None)."""
        self.discard(prefix_hash)
        evicted = None
        if not self._free:
            evicted = next((h for h in self._lru if h not in self._pinned), None)
            if evicted is None:
                return None, None
            self.discard(evicted)
        slot = self._free.take()
        self._lru[prefix_hash] = slot
        self._origin[prefix_hash], self._hits[prefix_hash] = origin, hits
        return slot, evicted

    def origin(self, prefix_hash: bytes) -> str | None:
        return self._origin.get(prefix_hash)

    def hits(self, prefix_hash: bytes) -> int:
        return self._hits.get(prefix_hash, 0)

    def record_hit(self, prefix_hash: bytes) -> None:
        """A restore: one more hit, and most recently used."""
        self._hits[prefix_hash] += 1
        self._lru.move_to_end(prefix_hash)

    def pin(self, prefix_hash: bytes) -> None:
        self._pinned.add(prefix_hash)

    def unpin(self, prefix_hash: bytes) -> None:
        self._pinned.discard(prefix_hash)

    def demote(self, prefix_hash: bytes) -> None:
        """First to be evicted."""
        if prefix_hash in self._lru:
            self._lru.move_to_end(prefix_hash, last=False)

    def discard(self, prefix_hash: bytes) -> bool:
        slot = self._lru.pop(prefix_hash, None)
        if slot is None:
            return False
        self._free.put(slot)
        del self._origin[prefix_hash], self._hits[prefix_hash]
        self._pinned.discard(prefix_hash)
        return True

    def clear(self) -> list[bytes]:
        dropped = list(self._lru)
        self._lru.clear()
        self._origin.clear()
        self._hits.clear()
        self._pinned.clear()
        self._free.reset()
        return dropped
