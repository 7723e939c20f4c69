"""Rows of the device state buffer that hold mamba prefix snapshots (plain Python, no jax).

A row is free, reserved (a step is writing a state into it; not restorable yet), or holds a registered snapshot
keyed by its prefix hash. Registered snapshots sit in two LRU segments, probation (0) and protected (1): eviction
takes the least recently used of probation first, then of protected. The cache manager registers new snapshots on
probation and promotes one on a hit (a segmented LRU, so one-off snapshots cannot flush a shared prefix's state).
Pinned rows (a restore is scheduled from them) are never evicted or freed until unpinned.
Discarding a pinned snapshot unregisters it at once and frees its row at the last unpin.
Each snapshot keeps the `origin` it was registered with (why it was captured; the manager's demotion rule reads it)
and its number of hits (promotions).
"""
from collections import OrderedDict
from typing import Callable, Iterable

from cache.free_list import FreeList

NUM_PRIORITIES = 2


class SnapshotPool:
    def __init__(self, rows: Iterable[int], on_evict: Callable[[bytes], None] | None = None,
                 on_priority: Callable[[bytes], None] | None = None):
        """on_priority: told after a registered snapshot moved between segments (promote, protect, demote) or was
        evicted from them."""
        self.rows = tuple(rows)
        self.on_evict = on_evict or (lambda prefix_hash: None)
        self.on_priority = on_priority or (lambda prefix_hash: None)
        self._free = FreeList(self.rows)
        self._reserved: set[int] = set()
        self._lru: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(NUM_PRIORITIES)]
        self._priority: dict[bytes, int] = {}
        self._pins: dict[int, int] = {}
        self._hits: dict[bytes, int] = {}
        self._origin: dict[bytes, str] = {}
        self._doomed: set[int] = set()

    @property
    def capacity(self) -> int:
        return len(self.rows)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_registered(self) -> int:
        return len(self._priority)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def num_protected(self) -> int:
        return len(self._lru[-1])

    @property
    def num_in_use(self) -> int:
        return len(self.rows) - len(self._free)

    def __contains__(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self._priority

    def row_of(self, prefix_hash: bytes) -> int | None:
        p = self._priority.get(prefix_hash)
        return None if p is None else self._lru[p][prefix_hash]

    def registered(self) -> dict[bytes, int]:
        return {h: lru[h] for lru in self._lru for h in lru}

    def reserve(self, may_evict_protected: bool = True) -> int | None:
        """A row to write a new snapshot into, evicting the LRU unpinned snapshot if none is free; with
        may_evict_protected=False only a probation snapshot may go (None rather than evict a protected one)."""
        if not self._free and self.evict_lru(may_evict_protected) is None:
            return None
        row = self._free.take()
        self._reserved.add(row)
        return row

    def release(self, row: int) -> None:
        """Give back a reserved row that will not be registered."""
        self._reserved.remove(row)
        self._free.put(row)

    def register(self, prefix_hash: bytes, row: int, priority: int = 0, origin: str = "", hits: int = 0) -> None:
        """A reserved row now holds the state for prefix_hash; an older row for the same hash is dropped. `hits`:
        those it already had (a snapshot coming back from the host tier)."""
        self._reserved.remove(row)
        self.discard(prefix_hash)
        self._priority[prefix_hash] = priority
        self._lru[priority][prefix_hash] = row
        self._origin[prefix_hash] = origin
        if hits:
            self._hits[prefix_hash] = hits

    def priority(self, prefix_hash: bytes) -> int | None:
        return self._priority.get(prefix_hash)

    def origin(self, prefix_hash: bytes) -> str | None:
        return self._origin.get(prefix_hash)

    def touch(self, prefix_hash: bytes) -> None:
        self._lru[self._priority[prefix_hash]].move_to_end(prefix_hash)

    def hits(self, prefix_hash: bytes) -> int:
        return self._hits.get(prefix_hash, 0)

    def promote(self, prefix_hash: bytes, max_protected: int) -> None:
        """Count a hit and move the snapshot to the protected segment's MRU end (`protect`)."""
        self._hits[prefix_hash] = self._hits.get(prefix_hash, 0) + 1
        self.protect(prefix_hash, max_protected)

    def protect(self, prefix_hash: bytes, max_protected: int) -> None:
        """Move the snapshot to the protected segment's MRU end; if that segment then holds more than
        max_protected, its LRU snapshot drops back to probation's MRU end."""
        p = self._priority[prefix_hash]
        row = self._lru[p].pop(prefix_hash)
        self._priority[prefix_hash] = NUM_PRIORITIES - 1
        self._lru[-1][prefix_hash] = row
        moved = [prefix_hash] if p != NUM_PRIORITIES - 1 else []
        while len(self._lru[-1]) > max(max_protected, 1):
            old, old_row = self._lru[-1].popitem(last=False)
            self._priority[old] = 0
            self._lru[0][old] = old_row
            moved.append(old)
        for h in moved:
            self.on_priority(h)

    def demote(self, prefix_hash: bytes) -> None:
        """Move a snapshot to the front of the lowest priority class (first to be evicted)."""
        p = self._priority.get(prefix_hash)
        if p is None:
            return
        row = self._lru[p].pop(prefix_hash)
        self._priority[prefix_hash] = 0
        self._lru[0][prefix_hash] = row
        self._lru[0].move_to_end(prefix_hash, last=False)
        if p:
            self.on_priority(prefix_hash)

    def pin(self, row: int) -> None:
        self._pins[row] = self._pins.get(row, 0) + 1

    def unpin(self, row: int) -> None:
        n = self._pins[row] - 1
        if n:
            self._pins[row] = n
            return
        del self._pins[row]
        if row in self._doomed:
            self._doomed.remove(row)
            self._free.put(row)

    def discard(self, prefix_hash: bytes) -> bool:
        """Unregister a snapshot and free its row (at the last unpin if pinned)."""
        p = self._priority.pop(prefix_hash, None)
        if p is None:
            return False
        self._hits.pop(prefix_hash, None)
        del self._origin[prefix_hash]
        row = self._lru[p].pop(prefix_hash)
        if row in self._pins:
            self._doomed.add(row)
        else:
            self._free.put(row)
        return True

    def evict_lru(self, may_evict_protected: bool = True) -> bytes | None:
        """Evict the least recently used unpinned snapshot (lowest priority first). It is reported to on_evict
        before its row is freed (row_of still answers then: the cache manager may copy the row to the host tier)."""
        for lru in self._lru if may_evict_protected else self._lru[:-1]:
            for prefix_hash, row in lru.items():
                if row not in self._pins:
                    self.on_evict(prefix_hash)
                    self.discard(prefix_hash)
                    self.on_priority(prefix_hash)       # left the segments (a host tier may still hold it)
                    return prefix_hash
        return None

    def clear(self) -> list[bytes]:
        dropped = list(self._priority)
        for prefix_hash in dropped:
            self.discard(prefix_hash)
        return dropped
