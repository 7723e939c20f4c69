"""The copies between the device cache and the host tier that the bookkeeping has decided but not yet run (no jax).

The cache manager queues them as it decides (an eviction offloads a KV block or a snapshot row to a host slot; an
admission loads host blocks into fresh device blocks and a host snapshot into the sequence's live row); the
scheduler takes them all before it lends the buffers to the next step, and cache/host_tier_buffers.py runs them.

Order contract. The queue keeps the order of decisions in *phases*; a phase runs its saves (device -> host) first,
then its loads (host -> device), each kind as one batched copy. That order is right for every pair of decisions
except two, which start a new phase instead:
- a save reads a device block (row) that an earlier load of the phase writes (loaded, then evicted again);
- a save writes a host slot that an earlier load of the phase reads (its entry moved to the device and the slot
  was reused).
Within a phase a later decision for the same target replaces an earlier one (the slot or block was reused).
Nothing else touches the buffers between two steps, so every copy runs before the step that could overwrite its
source: an evicted device block or row is reused only by a later step.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TransferPhase:
    kv_saves: dict[int, int] = dataclasses.field(default_factory=dict)     # host block slot <- device block
    kv_loads: dict[int, int] = dataclasses.field(default_factory=dict)     # device block <- host block slot
    state_saves: dict[int, int] = dataclasses.field(default_factory=dict)  # host snapshot slot <- device row
    state_loads: dict[int, int] = dataclasses.field(default_factory=dict)  # device row <- host snapshot slot

    def __bool__(self) -> bool:
        return bool(self.kv_saves or self.kv_loads or self.state_saves or self.state_loads)


@dataclasses.dataclass
class TransferPlan:
    phases: list[TransferPhase]

    def __bool__(self) -> bool:
        return any(self.phases)

    @property
    def num_kv_saves(self) -> int:
        return sum(len(p.kv_saves) for p in self.phases)

    @property
    def num_kv_loads(self) -> int:
        return sum(len(p.kv_loads) for p in self.phases)

    @property
    def num_state_saves(self) -> int:
        return sum(len(p.state_saves) for p in self.phases)

    @property
    def num_state_loads(self) -> int:
        return sum(len(p.state_loads) for p in self.phases)


class TransferQueue:
    def __init__(self):
        self._phases = [TransferPhase()]
        self._loaded_from: dict[str, set[int]] = {"kv": set(), "state": set()}   # host slots the phase's loads read

    def save_block(self, device_block: int, host_slot: int) -> None:
        self._save("kv", device_block, host_slot)

    def load_block(self, host_slot: int, device_block: int) -> None:
        self._load("kv", host_slot, device_block)

    def save_row(self, device_row: int, host_slot: int) -> None:
        self._save("state", device_row, host_slot)

    def load_row(self, host_slot: int, device_row: int) -> None:
        self._load("state", host_slot, device_row)

    def take(self) -> TransferPlan:
        """Everything queued, in order; the queue is empty afterwards."""
        plan = TransferPlan([p for p in self._phases if p])
        self._new_phase()
        self._phases = self._phases[-1:]
        return plan

    def __bool__(self) -> bool:
        return any(self._phases)

    def _save(self, kind: str, source: int, host_slot: int) -> None:
        if source in getattr(self._phases[-1], f"{kind}_loads") or host_slot in self._loaded_from[kind]:
            self._new_phase()
        getattr(self._phases[-1], f"{kind}_saves")[host_slot] = source

    def _load(self, kind: str, host_slot: int, target: int) -> None:
        getattr(self._phases[-1], f"{kind}_loads")[target] = host_slot
        self._loaded_from[kind].add(host_slot)

    def _new_phase(self) -> None:
        self._phases.append(TransferPhase())
        self._loaded_from = {"kv": set(), "state": set()}
