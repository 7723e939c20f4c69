"""Which adapter sits in which device slot: LoRARequest -> slot, loaded on first use, shared by every sequence of
the same adapter, given back when none uses it (least recently used first).

An adapter is identified by its weights digest (peft_format.py), never by its name or id: the digest is the root of
its sequences' block hash chains (cache/hashing.py), so different adapters never share a cached prefix, the same
adapter does, and an adapter re-saved with new weights at the same path (read again: its weights file changed)
never meets the old one's blocks or snapshots.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from qnext.lora.adapter_stacks import AdapterStacks
from qnext.lora.peft_format import WEIGHTS_FILE, AdapterError, PeftAdapter, read_peft_adapter


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by name, a positive integer id and the directory PEFT saved it to."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")


@dataclasses.dataclass(frozen=True)
class ActiveAdapter:
    slot: int          # device slot 1..max_loras
    hash_root: bytes   # the weights digest: the root of its sequences' block hashes


class AdapterRegistry:
    def __init__(self, stacks: AdapterStacks):
        self.stacks = stacks
        self._read: dict[tuple, PeftAdapter] = {}       # (path, weights mtime_ns, size) -> adapter as read
        self._slots: dict[int, tuple[str, int]] = {}    # slot -> (digest, sequences using it)
        self._last_use: dict[int, int] = {}
        self._clock = 0

    def acquire(self, request: LoRARequest, count: int = 1) -> ActiveAdapter:
        """The slot holding request's adapter, loaded if needed, held for `count` sequences."""
        adapter = self._adapter(request)
        slot = next((s for s, (d, _) in self._slots.items() if d == adapter.digest), None)
        if slot is None:
            slot = self._free_slot(request)
            self.stacks.write(slot, adapter)
            self._slots[slot] = (adapter.digest, 0)
        digest, users = self._slots[slot]
        self._slots[slot] = (digest, users + count)
        self._clock += 1
        self._last_use[slot] = self._clock
        return ActiveAdapter(slot, hashlib.sha256(b"lora:" + digest.encode()).digest()[:16])

    def release(self, active: ActiveAdapter) -> None:
        digest, users = self._slots[active.slot]
        self._slots[active.slot] = (digest, max(0, users - 1))

    def _adapter(self, request: LoRARequest) -> PeftAdapter:
        weights = Path(request.lora_path) / WEIGHTS_FILE
        stat = weights.stat() if weights.is_file() else None
        key = (str(Path(request.lora_path).resolve()), stat and stat.st_mtime_ns, stat and stat.st_size)
        if key not in self._read:
            adapter = read_peft_adapter(request.lora_path)
            self.stacks.check(adapter)
            self._read[key] = adapter
        return self._read[key]

    def _free_slot(self, request: LoRARequest) -> int:
        for slot in range(1, self.stacks.max_loras + 1):
            if slot not in self._slots:
                return slot
        idle = [s for s, (_, users) in self._slots.items() if users == 0]
        if not idle:
            raise AdapterError(f"adapter {request.lora_name!r} cannot be loaded: all max_loras="
                               f"{self.stacks.max_loras} slots hold adapters of unfinished requests")
        return min(idle, key=self._last_use.__getitem__)
