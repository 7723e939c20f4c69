"""The free ids of one pool: KV blocks (block_pool.py), snapshot rows (snapshot_pool.py), host-tier block and
snapshot slots (host_blocks.py, host_snapshots.py). Plain Python, no jax.

Each pool decides what to evict when nothing is free; this class only hands ids out and takes them back, in a fixed
order so that runs are reproducible: `ids` are handed out first to last, then the ids given back, the most recently
given back first (`fifo=False`, a stack) or the longest free first (`fifo=True`, a queue).
"""
from collections import deque
from typing import Iterable, Iterator


class FreeList:
    def __init__(self, ids: Iterable[int], fifo: bool = False):
        self._ids = tuple(ids)
        self.fifo = fifo
        self._free: deque[int] = deque(self._ids)

    def __len__(self) -> int:
        return len(self._free)

    def __iter__(self) -> Iterator[int]:
        return iter(self._free)

    def take(self) -> int:
        """The next free id; IndexError when none is free (pools check `len` or evict first)."""
        if not self._free:
            raise IndexError("no free id: evict first")
        return self._free.popleft()

    def put(self, free_id: int) -> None:
        if self.fifo:
            self._free.append(free_id)
        else:
            self._free.appendleft(free_id)

    def reset(self) -> None:
        """Every id free again, in the initial order."""
        self._free = deque(self._ids)
