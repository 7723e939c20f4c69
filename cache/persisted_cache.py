"""A prefix cache that survives restarts (device-side: reads the device buffers): `save_prefix_cache` writes the
cache's index (cache/cache_index.py) and the contents of both tiers to `<prefix_cache_dir>/prefix_cache.qnext`
(cache/cache_file.py); `load_prefix_cache` reads a file written for the same fingerprint into the host tier of a
fresh cache, from where the first requests that match load it back like any host-tier hit.

Arrays of the file: the index's (block_hashes, block_uids, block_parents, block_tokens, snapshot_hashes,
snapshot_terminals, snapshot_origins, snapshot_hits), then per full-attention layer i `kv.{i}.k` / `kv.{i}.v`
[Hkv, num_blocks, block_size, D] and per linear-attention layer i `conv.{i}` [num_snapshots, K-1, conv_dim] /
`recurrent.{i}` [num_snapshots, Hv, dk, dv] (float32), in index order, whichever tier held them.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cache.cache_index import DEVICE, CacheIndex, export_index, import_index, index_arrays, index_from_arrays
from cache.buffer_copies import gather_device_blocks, gather_device_rows
from cache.host_tier_buffers import HostTierBuffers
from cache.manager import CacheManager
from cache.cache_file import ArraySpec, read_cache_file, write_cache_file


def save_prefix_cache(directory: str | os.PathLike, cache: CacheManager, host: HostTierBuffers | None,
                      fingerprint: dict) -> Path:
    """Writes every cached block and valid snapshot of both tiers. The cache must hold its buffers, with no copies
    between tiers pending (Scheduler.flush_transfers)."""
    if cache.buffers is None:
        raise RuntimeError("the cache's buffers are lent to a step; save the prefix cache between steps")
    if cache.tier.transfers:
        raise RuntimeError("copies between tiers are pending; run them first (Scheduler.flush_transfers)")
    index = export_index(cache)
    specs = [ArraySpec(name, a.dtype.name, a.shape, lambda a=a: a) for name, a in index_arrays(index).items()]
    buffers = cache.buffers
    n, s = index.num_blocks, index.num_snapshots
    for i, (k, v) in enumerate(buffers.kv):
        for part, pages in (("k", k), ("v", v)):
            shape = (pages.shape[0], n) + tuple(pages.shape[2:])
            make = (lambda i=i, part=part: _blocks(index, buffers, host, i, part))
            specs.append(ArraySpec(f"kv.{i}.{part}", np.dtype(pages.dtype).name, shape, make))
    for i, (conv, recurrent) in enumerate(zip(buffers.conv, buffers.recurrent)):
        for part, rows in (("conv", conv), ("recurrent", recurrent)):
            make = (lambda i=i, part=part: _rows(index, buffers, host, i, part))
            specs.append(ArraySpec(f"{part}.{i}", np.dtype(_stored_dtype(buffers, host, i, part)).name,
                                   (s,) + tuple(rows.shape[1:]), make))
    header = {"fingerprint": fingerprint, "num_blocks": n, "num_snapshots": s, "block_size": index.block_size}
    return write_cache_file(directory, header, specs)


def load_prefix_cache(directory: str | os.PathLike, cache: CacheManager, host: HostTierBuffers,
                      fingerprint: dict) -> tuple[int, int]:
    """Loads a matching cache file into the host tier of `cache` (nothing used yet). Returns (blocks, snapshots)
    kept; (0, 0) when there is no usable file (a damaged or foreign one is reported and ignored)."""
    file = read_cache_file(directory, fingerprint)
    if file is None:
        return 0, 0
    try:
        names = ("block_hashes", "block_uids", "block_parents", "block_tokens", "snapshot_hashes",
                 "snapshot_terminals", "snapshot_origins", "snapshot_hits")
        index = index_from_arrays(file.header["block_size"], {name: file.array(name) for name in names})
        block_slots, snapshot_slots = import_index(cache, index)
        kept_blocks = [(i, slot) for i, slot in enumerate(block_slots) if slot is not None]
        kept_rows = [(i, slot) for i, slot in enumerate(snapshot_slots) if slot is not None]
        for i, (k, v) in enumerate(host.kv):
            for part, pages in (("k", k), ("v", v)):
                _copy(file.array(f"kv.{i}.{part}"), pages, kept_blocks, axis=1)
        for i, (conv, recurrent) in enumerate(zip(host.conv, host.recurrent)):
            _copy(file.array(f"conv.{i}"), conv, kept_rows, axis=0)
            _copy(file.array(f"recurrent.{i}"), recurrent, kept_rows, axis=0)
        return len(kept_blocks), len(kept_rows)
    finally:
        file.close()


def _copy(source: np.ndarray, target: np.ndarray, pairs: list[tuple[int, int]], axis: int) -> None:
    """target[slot] = source[i] along `axis` for each (i, slot)."""
    if pairs:
        index, slots = np.array([i for i, _ in pairs]), np.array([slot for _, slot in pairs])
        if axis == 1:
            target[:, slots] = source[:, index]
        else:
            target[slots] = source[index]


def _blocks(index: CacheIndex, buffers, host: HostTierBuffers | None, layer: int, part: str) -> np.ndarray:
    """One KV layer's k or v of every indexed block, in index order, from whichever tier holds it."""
    on_device = [i for i, (tier, _) in enumerate(index.block_sources) if tier == DEVICE]
    on_host = [i for i, (tier, _) in enumerate(index.block_sources) if tier != DEVICE]
    which = part == "v"
    pages = buffers.kv[layer][which]
    out = np.zeros((pages.shape[0], index.num_blocks) + tuple(pages.shape[2:]), np.dtype(pages.dtype))
    if on_device:
        got = gather_device_blocks((buffers.kv[layer],), [index.block_sources[i][1] for i in on_device])
        out[:, on_device] = got[0][which]
    if on_host:
        out[:, on_host] = host.kv[layer][which][:, [index.block_sources[i][1] for i in on_host]]
    return out


def _rows(index: CacheIndex, buffers, host: HostTierBuffers | None, layer: int, part: str) -> np.ndarray:
    """One linear-attention layer's conv or recurrent state of every indexed snapshot, in index order."""
    on_device = [i for i, (tier, _) in enumerate(index.snapshot_sources) if tier == DEVICE]
    on_host = [i for i, (tier, _) in enumerate(index.snapshot_sources) if tier != DEVICE]
    rows = getattr(buffers, part)[layer]
    out = np.zeros((index.num_snapshots,) + tuple(rows.shape[1:]), np.dtype(_stored_dtype(buffers, host, layer, part)))
    if on_device:
        out[on_device] = gather_device_rows(buffers, [index.snapshot_sources[i][1] for i in on_device], layer, part)
    if on_host:
        out[on_host] = getattr(host, part)[layer][[index.snapshot_sources[i][1] for i in on_host]]
    return out


def _stored_dtype(buffers, host: HostTierBuffers | None, layer: int, part: str):
    """A snapshot's `part` as stored: narrower with mamba_ssm_cache_dtype (the host tier's, or the device pool's)."""
    if host is not None:
        return getattr(host, part)[layer].dtype
    return (getattr(buffers, "snapshot_" + part) or getattr(buffers, part))[layer].dtype
