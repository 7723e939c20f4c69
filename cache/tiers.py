"""The host tier's decisions: what the device cache evicts goes to host slots instead of being dropped, and what an
admission matches there comes back (plain Python, no jax; the copies are queued, cache/transfers.py).

Tiers are exclusive: a published KV block lives on the device or in the host tier, never both, and keeps its uid
(its identity) while it moves; a chain hash names at most one block across the tiers; a snapshot lives in the
device's snapshot pool or in the host tier. The invariant of the single-tier cache, extended: a snapshot is valid
while its terminal KV block is resident in *some* tier, so a block moving between tiers takes its snapshots along
(registry `retie`), and only a block that leaves the last tier invalidates snapshots: exactly those tied to it,
and those tied to the host blocks below it (unreachable without it).

- Device eviction (any path but clear): the block is offloaded (a save is queued: it runs before the next step,
  which is the first that can overwrite the device block) unless the host tier has no room; then it and the host
  blocks below it are dropped.
- Admission: the match walks device blocks, then host blocks (`match`); the blocks it uses up to the restored
  snapshot are loaded into fresh device blocks and published there at once (`moved_to_device`). A restored
  snapshot held in the host tier is loaded into the sequence's own live row and stays here (`restore_snapshot`),
  unless it earned a pool row (a branch point, or restored before: the manager's rule), then it moves back into
  a snapshot row with its origin and hits (`snapshot_to_device`) and is promoted there like any hit.
- A device publish of a block the host tier holds (recomputed, e.g. past the usable snapshot) adopts its uid and
  frees the host copy; a host block under the same hash but another prefix (a hash collision) is dropped.
- Snapshot-pool eviction: the row is offloaded (`offload_snapshot`), evicting the host tier's LRU snapshot if full.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from cache.host_blocks import HostBlock, HostBlockStore
from cache.host_snapshots import HostSnapshotStore
from cache.mamba_registry import MambaPrefixRegistry
from cache.stats import TierStats
from cache.transfers import TransferPlan, TransferQueue

HOST = "host"


def host_terminal(uid: int) -> tuple[str, int]:
    """The registry's name for a block held in the host tier (a device block is named by its block id)."""
    return (HOST, uid)


@dataclasses.dataclass(frozen=True)
class PublishedBlock:
    uid: int
    hash: bytes
    parent_uid: int | None
    token_ids: tuple[int, ...]


class HostTier:
    def __init__(self, num_blocks: int, num_snapshots: int, registry: MambaPrefixRegistry, stats: TierStats):
        self.blocks = HostBlockStore(num_blocks)
        self.snapshots = HostSnapshotStore(num_snapshots)
        self.registry = registry
        self.stats = stats
        self.transfers = TransferQueue()
        self._device: dict[int, PublishedBlock] = {}     # published device block id -> its identity
        self._next_uid = 1

    # ---- identities of the device's published blocks -------------------------------------------------------------
    def uid(self, block_id: int) -> int:
        return self._device[block_id].uid

    def device_blocks(self) -> dict[int, PublishedBlock]:
        return self._device

    def new_uid(self) -> int:
        self._next_uid += 1
        return self._next_uid - 1

    def published_on_device(self, block_id: int, block_hash: bytes, parent_block: int | None,
                            token_ids: Sequence[int]) -> list:
        """Record a block the device cache just published. If the host tier held the same block (same parent, same
        tokens), the device block takes over its identity and snapshots and the host copy is freed; a host block
        under the same hash but another prefix is dropped with the blocks below it. Returns the registry names of
        the blocks that left every tier."""
        parent_uid = None if parent_block is None else self._device[parent_block].uid
        held = self.blocks.get(block_hash)
        same = held is not None and held.parent_uid == parent_uid and held.token_ids == tuple(token_ids)
        dropped = [] if same or held is None else self._dropped(self.blocks.drop_subtree(held.uid))
        uid = held.uid if same else self.new_uid()
        self._device[block_id] = PublishedBlock(uid, block_hash, parent_uid, tuple(token_ids))
        if same:
            self.blocks.remove(uid)
            self.registry.retie(host_terminal(uid), block_id)
        return dropped

    # ---- device eviction -----------------------------------------------------------------------------------------
    def evicted_from_device(self, block_ids: Sequence[int], offload: bool) -> list:
        """Blocks the device cache unpublished (leaves first). Offloads each if `offload` and there is room, else
        drops it with the host blocks below it. Returns the registry names of the blocks that left every tier."""
        dropped = []
        for block_id in block_ids:
            b = self._device.pop(block_id)
            entry = None
            if offload:
                entry, evicted = self.blocks.insert(b.uid, b.hash, b.parent_uid, b.token_ids)
                dropped += self._dropped(evicted)
            if entry is not None:
                self.transfers.save_block(block_id, entry.slot)
                self.registry.retie(block_id, host_terminal(b.uid))
                self.stats.blocks_offloaded += 1
            else:
                dropped.append(block_id)
                dropped += self._dropped(self.blocks.drop_subtree(b.uid))
        return dropped

    # ---- admission -----------------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
              device_chain: list[int]) -> list[HostBlock]:
        """The host blocks that continue a device match (`device_chain`, the matched device blocks) along `hashes`."""
        if not len(self.blocks) or len(device_chain) >= len(hashes):
            return []
        parent_uid = self._device[device_chain[-1]].uid if device_chain else None
        return self.blocks.match(hashes, token_ids, block_size, len(device_chain), parent_uid)

    def pin(self, entries: Sequence[HostBlock]) -> None:
        for e in entries:
            e.pinned = True

    def moved_to_device(self, entry: HostBlock, block_id: int) -> None:
        """The device cache published `block_id` for a pinned host entry: load its KV there, free the host slot."""
        self.transfers.load_block(entry.slot, block_id)
        self.blocks.remove(entry.uid)
        self._device[block_id] = PublishedBlock(entry.uid, entry.hash, entry.parent_uid, entry.token_ids)
        self.registry.retie(host_terminal(entry.uid), block_id)
        self.stats.blocks_loaded += 1

    def touch(self, entries: Sequence[HostBlock]) -> None:
        self.blocks.touch(entries)

    # ---- snapshots -----------------------------------------------------------------------------------------------
    def snapshot_to_device(self, prefix_hash: bytes, row: int) -> tuple[str, int]:
        """Load a host-held snapshot into a reserved snapshot row (it moves back to the device's pool); returns the
        origin and hits it had, for the pool."""
        meta = self.snapshots.origin(prefix_hash), self.snapshots.hits(prefix_hash)
        self.transfers.load_row(self.snapshots.slot_of(prefix_hash), row)
        self.snapshots.discard(prefix_hash)
        self.stats.snapshots_loaded += 1
        return meta

    def restore_snapshot(self, prefix_hash: bytes, live_row: int) -> None:
        """Load a host-held snapshot into a sequence's live row (it stays here, most recently used): when no
        snapshot row can be had for it."""
        self.transfers.load_row(self.snapshots.slot_of(prefix_hash), live_row)
        self.snapshots.record_hit(prefix_hash)
        self.stats.snapshots_loaded += 1

    def offload_snapshot(self, prefix_hash: bytes, row: int, origin: str, hits: int) -> tuple[bool, bytes | None]:
        """The snapshot pool evicts `row` (a snapshot of that origin and hit count): keep its state here. Returns
        (kept; the host snapshot evicted for room)."""
        slot, evicted = self.snapshots.insert(prefix_hash, origin, hits)
        if slot is None:
            return False, None
        self.transfers.save_row(row, slot)
        self.stats.snapshots_offloaded += 1
        self.stats.host_snapshots_dropped += evicted is not None
        return True, evicted

    # ---- the rest ------------------------------------------------------------------------------------------------
    def clear(self) -> list:
        """Drop every host block (the registry names of them) and snapshot; queued copies still run."""
        dropped = self._dropped(self.blocks.clear())
        self.snapshots.clear()
        return dropped

    def take_transfers(self) -> TransferPlan:
        return self.transfers.take()

    def _dropped(self, entries: list[HostBlock]) -> list:
        self.stats.host_blocks_dropped += len(entries)
        return [host_terminal(e.uid) for e in entries]
