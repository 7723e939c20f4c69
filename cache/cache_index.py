"""What a cache holds, independent of tiers and ids: the index a persisted cache is written with and read back from
(plain Python, no jax; the file format is cache/cache_file.py, the data cache/device_buffers.py and cache/host_tier_buffers.py).

`export_index` lists every published KV block (device and host tier) and every valid snapshot, most recently used
first (device before host), each with where its data is now. `import_index` puts an index into a fresh manager's
host tier: as many blocks as it has slots, most recent first, each with the blocks above it (a block is only
useful under its whole prefix), then the snapshots whose terminal block was kept, as many as it has slots.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cache.snapshot_lifecycle import BRANCH, CHECKPOINT, PROMPT_END, SEQUENCE_END
from cache.tiers import HOST, host_terminal

DEVICE = "device"
ORIGINS = ("", PROMPT_END, CHECKPOINT, BRANCH, SEQUENCE_END)     # a snapshot's origin in the file: its index here


@dataclasses.dataclass
class CacheIndex:
    block_size: int
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    block_uids: list[int] = dataclasses.field(default_factory=list)
    block_parents: list[int] = dataclasses.field(default_factory=list)     # parent uid; -1 for a first block
    block_tokens: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    block_sources: list[tuple[str, int]] = dataclasses.field(default_factory=list)     # (DEVICE, block) | (HOST, slot)
    snapshot_hashes: list[bytes] = dataclasses.field(default_factory=list)
    snapshot_terminals: list[int] = dataclasses.field(default_factory=list)   # uid of the terminal block
    snapshot_origins: list[str] = dataclasses.field(default_factory=list)     # why it was captured (ORIGINS)
    snapshot_hits: list[int] = dataclasses.field(default_factory=list)        # restores so far
    snapshot_sources: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (DEVICE, row) | (HOST, slot)

    @property
    def num_blocks(self) -> int:
        return len(self.block_uids)

    @property
    def num_snapshots(self) -> int:
        return len(self.snapshot_hashes)


def export_index(cm) -> CacheIndex:
    """The index of a CacheManager's cached blocks and valid snapshots, most recently used first."""
    index = CacheIndex(cm.config.block_size)
    tier = cm.tier
    on_device = sorted(tier.device_blocks().items(), key=lambda item: -cm.blocks.last_used(item[0]))
    on_host = sorted(tier.blocks.entries(), key=lambda e: -e.last_used)
    for source, where, b in [(DEVICE, b, p) for b, p in on_device] + [(HOST, e.slot, e) for e in on_host]:
        index.block_hashes.append(b.hash)
        index.block_uids.append(b.uid)
        index.block_parents.append(-1 if b.parent_uid is None else b.parent_uid)
        index.block_tokens.append(tuple(b.token_ids))
        index.block_sources.append((source, where))
    device_rows = list(reversed(cm.snapshots.registered().items()))
    host_slots = list(reversed(list(tier.snapshots.items())))
    for source, store, items in ((DEVICE, cm.snapshots, device_rows), (HOST, tier.snapshots, host_slots)):
        for prefix_hash, where in items:
            terminal = cm.registry.mamba_prefix_block_by_hash[prefix_hash]
            index.snapshot_hashes.append(prefix_hash)
            index.snapshot_origins.append(store.origin(prefix_hash) or "")
            index.snapshot_hits.append(store.hits(prefix_hash))
            index.snapshot_terminals.append(terminal[1] if isinstance(terminal, tuple) else tier.uid(terminal))
            index.snapshot_sources.append((source, where))
    return index


def import_index(cm, index: CacheIndex) -> tuple[list[int | None], list[int | None]]:
    """Puts `index` into the host tier of `cm`, a manager nothing has used yet. Returns the host slot of every
    block and snapshot of the index (None: not kept), for the data to be copied there."""
    if cm.tier.device_blocks() or len(cm.tier.blocks) or len(cm.tier.snapshots):
        raise RuntimeError("import_index needs a cache manager nothing has used yet")
    if index.block_size != cm.config.block_size:
        raise ValueError(f"the index has blocks of {index.block_size} tokens; this cache {cm.config.block_size}")
    tier = cm.tier
    position = {uid: i for i, uid in enumerate(index.block_uids)}
    kept: dict[int, None] = {}                   # index positions, each after its parent (insertion order)
    for i in range(index.num_blocks):
        chain = _missing_prefix(index, position, kept, i)
        if chain is not None and len(kept) + len(chain) <= tier.blocks.num_slots:
            kept.update(dict.fromkeys(reversed(chain)))
    block_slots: list[int | None] = [None] * index.num_blocks
    new_uid: dict[int, int] = {}
    for i in kept:
        parent = index.block_parents[i]
        if parent >= 0 and parent not in new_uid:
            continue
        uid = tier.new_uid()
        entry, _ = tier.blocks.insert(uid, index.block_hashes[i], None if parent < 0 else new_uid[parent],
                                      index.block_tokens[i])
        if entry is not None:                    # (a repeated hash is kept once)
            new_uid[index.block_uids[i]] = uid
            block_slots[i] = entry.slot
    for i in reversed(range(index.num_blocks)):  # least recently used first, so the LRU order carries over
        if block_slots[i] is not None:
            tier.touch([tier.blocks.by_uid(new_uid[index.block_uids[i]])])
    snapshot_slots: list[int | None] = [None] * index.num_snapshots
    chosen = [j for j in range(index.num_snapshots) if index.snapshot_terminals[j] in new_uid]
    for j in reversed(chosen[:tier.snapshots.num_slots]):                 # least recently used first
        prefix_hash = index.snapshot_hashes[j]
        origin = index.snapshot_origins[j] if index.snapshot_origins else ""
        hits = index.snapshot_hits[j] if index.snapshot_hits else 0
        snapshot_slots[j], _ = tier.snapshots.insert(prefix_hash, origin, hits)
        cm.registry.capture_mamba_prefix_state(prefix_hash, host_terminal(new_uid[index.snapshot_terminals[j]]))
    cm.stats.tiers.blocks_from_disk += len(new_uid)
    cm.stats.tiers.snapshots_from_disk += sum(s is not None for s in snapshot_slots)
    return block_slots, snapshot_slots


def _missing_prefix(index: CacheIndex, position: dict[int, int], kept: dict[int, None], i: int) -> list[int] | None:
    """Block i and its ancestors not kept yet (i first); None if an ancestor is not in the index."""
    chain = []
    while i not in kept:
        chain.append(i)
        parent = index.block_parents[i]
        if parent < 0:
            break
        if parent not in position:
            return None
        i = position[parent]
    return chain



def index_arrays(index: CacheIndex) -> dict[str, np.ndarray]:
    """The index as arrays for the cache file (data sources are not part of it: the data follows in index order)."""
    hash_len = len(index.block_hashes[0]) if index.block_hashes else 16
    if any(len(h) != hash_len for h in index.block_hashes + index.snapshot_hashes):
        raise ValueError("a persisted index needs block hashes of one length")
    return {
        "block_hashes": _hash_array(index.block_hashes, hash_len),
        "block_uids": np.asarray(index.block_uids, np.int64).reshape(-1),
        "block_parents": np.asarray(index.block_parents, np.int64).reshape(-1),
        "block_tokens": np.asarray(index.block_tokens, np.int64).reshape(-1, index.block_size),
        "snapshot_hashes": _hash_array(index.snapshot_hashes, hash_len),
        "snapshot_terminals": np.asarray(index.snapshot_terminals, np.int64).reshape(-1),
        "snapshot_origins": np.asarray([ORIGINS.index(o) for o in index.snapshot_origins], np.int8).reshape(-1),
        "snapshot_hits": np.asarray(index.snapshot_hits, np.int64).reshape(-1),
    }


def index_from_arrays(block_size: int, arrays: dict[str, np.ndarray]) -> CacheIndex:
    return CacheIndex(
        block_size=block_size,
        block_hashes=[bytes(h) for h in arrays["block_hashes"]],
        block_uids=arrays["block_uids"].tolist(),
        block_parents=arrays["block_parents"].tolist(),
        block_tokens=[tuple(t) for t in arrays["block_tokens"].tolist()],
        snapshot_hashes=[bytes(h) for h in arrays["snapshot_hashes"]],
        snapshot_terminals=arrays["snapshot_terminals"].tolist(),
        snapshot_origins=[ORIGINS[i] for i in arrays["snapshot_origins"].tolist()],
        snapshot_hits=arrays["snapshot_hits"].tolist())


def _hash_array(hashes: list[bytes], hash_len: int) -> np.ndarray:
    return np.frombuffer(b"".join(hashes), np.uint8).reshape(len(hashes), hash_len).copy()
