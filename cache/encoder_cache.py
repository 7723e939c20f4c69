"""The vision tower's outputs, kept by image content hash within a byte budget (plain Python, no jax).

A second chat turn resends the same pictures; their embeddings come from here instead of another tower run, and
a prefix-cache hit that ends inside an image still has the rest of that image's embeddings. Keys are the full
SHA-256 content hashes (cache/image_keys.py), so two pictures never share an entry. Values are opaque (device
arrays); the caller says how many bytes each holds. Least recently used entries go first when the budget is
exceeded; an entry larger than the whole budget is not kept.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any


@dataclasses.dataclass
class EncoderCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in_use: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class EncoderCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"encoder cache budget {budget_bytes} bytes must be >= 0 (0 keeps nothing)")
        self.budget_bytes = budget_bytes
        self.stats = EncoderCacheStats()
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def get(self, content_hash: bytes) -> Any | None:
        """The cached output (now the most recently used), or None (counted as a miss)."""
        entry = self._entries.get(content_hash)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self.stats.hits += 1
        return entry[0]

    def put(self, content_hash: bytes, value: Any, nbytes: int) -> None:
        if content_hash in self._entries:
            self._drop(content_hash)
        if nbytes > self.budget_bytes:
            return
        self._entries[content_hash] = (value, nbytes)
        self.stats.bytes_in_use += nbytes
        while self.stats.bytes_in_use > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1

    def clear(self) -> None:
        """Drops every entry (new weights make every output stale)."""
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, content_hash: bytes) -> None:
        _, nbytes = self._entries.pop(content_hash)
        self.stats.bytes_in_use -= nbytes
