"""Which adapter sits in which device slot, and which adapters are kept in host memory.

A request names its adapter with a LoRARequest; `use` reads it (from the host cache, else from disk) and checks it
against the model, and the request's samples share the returned AdapterUse. `bind` gives the use a device slot when
the scheduler admits the request: the slot already holding the same weights, else a free one, else the least
recently used slot that no unfinished request holds (its adapter written there in one jitted call). When every slot
holds adapters of unfinished requests, `bind` says no and the request waits in the queue (vLLM's behaviour) while
requests of the base model and of loaded adapters go ahead. Each finished or aborted sample releases its hold.

Host memory (vLLM's `max_cpu_loras`): adapters as read are kept in an LRU of that many, so that an adapter
evicted from its device slot is written back from memory, not read from disk again; an adapter in a device slot
is never the one evicted (max_cpu_loras >= max_loras).

An adapter is identified by its weights digest (peft_format.py), never by its name or id: the digest is the root of
its sequences' block hash chains (cache/hashing.py), so different adapters never share a cached prefix, the same
adapter does, and an adapter re-saved with new weights at the same path (read again: its weights file changed)
never meets the old one's blocks or snapshots.
"""
from __future__ import annotations

import collections
import dataclasses

from qnext.lora.adapter_stacks import AdapterStacks
from qnext.lora.identity import hash_root, weights_key
from qnext.lora.peft_format import PeftAdapter, read_peft_adapter


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by name, a positive integer id and the directory PEFT saved it to."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")


@dataclasses.dataclass
class AdapterUse:
    """One request's use of an adapter, shared by its samples."""

    adapter: PeftAdapter
    hash_root: bytes           # the weights digest's: the root of its sequences' block hashes
    users: int                 # its samples not yet finished
    registry: "AdapterRegistry" = dataclasses.field(repr=False)
    slot: int | None = None    # device slot 1..max_loras once bound (the scheduler binds it at admission)

    def bind(self) -> bool:
        """A device slot for it (AdapterRegistry.bind); False: every slot is held, the request waits."""
        return self.registry.bind(self)


class AdapterRegistry:
    def __init__(self, stacks: AdapterStacks, max_cpu_loras: int | None = None):
        max_cpu_loras = stacks.max_loras if max_cpu_loras is None else max_cpu_loras
        if max_cpu_loras < stacks.max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({stacks.max_loras})")
        self.stacks, self.max_cpu_loras = stacks, max_cpu_loras
        # (path, weights mtime_ns, size) -> adapter as read; least recently used first
        self._host: collections.OrderedDict[tuple, PeftAdapter] = collections.OrderedDict()
        self._slots: dict[int, tuple[str, int]] = {}    # slot -> (digest, samples holding it)
        self._last_use: dict[int, int] = {}
        self._clock = 0
        self.num_disk_reads = 0

    def use(self, request: LoRARequest, count: int = 1) -> AdapterUse:
        """request's adapter for `count` samples, read and checked (AdapterError naming what is wrong)."""
        adapter = self._adapter(request)
        return AdapterUse(adapter, hash_root(adapter.digest), count, self)

    def bind(self, use: AdapterUse) -> bool:
        """Gives `use` a device slot (loading its adapter there if needed); False when every slot is held."""
        if use.slot is not None:
            return True
        digest = use.adapter.digest
        slot = next((s for s, (d, _) in self._slots.items() if d == digest), None)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self.stacks.write(slot, use.adapter)
            self._slots[slot] = (digest, 0)
        self._slots[slot] = (digest, self._slots[slot][1] + use.users)
        self._clock += 1
        self._last_use[slot] = self._clock
        use.slot = slot
        return True

    def release(self, use: AdapterUse) -> None:
        """One sample of `use` is done."""
        use.users -= 1
        if use.slot is not None:
            digest, users = self._slots[use.slot]
            self._slots[use.slot] = (digest, max(0, users - 1))

    def _adapter(self, request: LoRARequest) -> PeftAdapter:
        key = weights_key(request.lora_path)
        if key in self._host:
            self._host.move_to_end(key)
            return self._host[key]
        adapter = read_peft_adapter(request.lora_path)
        self.stacks.check(adapter)
        self.num_disk_reads += 1
        self._host[key] = adapter
        self._evict_host()
        return adapter

    def _evict_host(self) -> None:
        """Least recently used first, never one whose weights sit in a device slot."""
        on_device = {d for d, _ in self._slots.values()}
        for key in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                return
            if self._host[key].digest not in on_device:
                del self._host[key]

    def _free_slot(self) -> int | None:
        for slot in range(1, self.stacks.max_loras + 1):
            if slot not in self._slots:
                return slot
        idle = [s for s, (_, users) in self._slots.items() if users == 0]
        return min(idle, key=self._last_use.__getitem__) if idle else None
