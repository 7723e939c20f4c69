"""The engine's cache: the cache manager (host bookkeeping, owner of the device buffers) and the host tier's
arrays, held together because every lending of the buffers first runs the copies the manager decided between them.

The scheduler plans with the manager and lends the buffers to each step; the engine warms the copies up, reports
usage, and writes the persisted cache at close (docs/cache.md).
"""
from __future__ import annotations

import logging
from pathlib import Path

from cache import CacheManager
from cache.buffer_copies import write_blocks_and_rows
from cache.device_buffers import CacheBuffers
from cache.host_tier_buffers import HostTierBuffers
from cache.fork_buffer_copies import apply_fork_copies
from cache.persisted_cache import load_prefix_cache, save_prefix_cache
from qnext.engine.cache_setup import CacheSetup

logger = logging.getLogger("qnext.engine")


class EngineCache:
    def __init__(self, setup: CacheSetup, host_buffers: HostTierBuffers | None):
        self.manager = CacheManager(setup.config)     # it owns the device buffers
        self.manager.attach_buffers(setup.buffers)
        self.host_buffers = host_buffers      # the host tier's arrays (None: no host tier)
        self._writes: list[tuple] = []        # KV blocks and state rows computed elsewhere (write_transferred)
        if setup.prefix_cache_dir is not None:
            self._load(setup.prefix_cache_dir, setup.fingerprint)

    def lend_buffers(self) -> CacheBuffers:
        """The buffers for a step, after the fork copies and the copies between tiers decided so far have run on
        them (so each runs before the step that could overwrite its source or needs its target)."""
        m = self.manager
        buffers = apply_fork_copies(m.take_fork_copies(), m.lend_buffers())   # first: cache/forks.py
        transfers = m.take_transfers()
        if transfers:
            if self.host_buffers is None:
                raise RuntimeError("the cache manager has a host tier but the engine has no host buffers")
            buffers = self.host_buffers.apply(transfers, buffers, m.stats.tiers)
        for write in self._writes:    # last: an offload of an evicted block they reuse reads it first
            buffers = write_blocks_and_rows(buffers, *write)
        self._writes = []
        return buffers

    def write_transferred(self, blocks: list[int], kv: tuple, row: int, conv: tuple, recurrent: tuple) -> None:
        """Queues the write of a transferred prompt's KV blocks and state (engine/pd_transfer.py) into the blocks
        and live row its admission gave it; it runs before the next step."""
        self._writes.append((blocks, kv, [row], conv, recurrent))

    def return_buffers(self, buffers: CacheBuffers) -> None:
        self.manager.return_buffers(buffers)

    def flush_transfers(self) -> None:
        """Runs the pending copies between tiers now (before the cache is written to disk)."""
        self.return_buffers(self.lend_buffers())

    def usage(self) -> dict:
        """Pool occupancy now: shares (0-1) of KV blocks in use, live state rows in use, snapshot rows in use; the
        KV blocks holding a cached prefix; and the host tier's KV blocks and snapshots held (0 without one)."""
        m, blocks, pool = self.manager, self.manager.blocks, self.manager.snapshots
        live = m.config.num_live_slots
        return {"kv_cache_usage": blocks.num_used / max(1, blocks.num_blocks - 1),      # block 0 is the dummy
                "kv_blocks_cached": blocks.num_cached,
                "state_slots_usage": (live - m.num_free_slots) / max(1, live),
                "snapshot_pool_usage": pool.num_in_use / pool.capacity if pool.capacity else 0.0,
                "host_kv_blocks_cached": len(m.tier.blocks), "host_snapshots_cached": len(m.tier.snapshots)}

    def save(self, directory: str, fingerprint: dict) -> Path | None:
        """Writes the prefix cache (its index and both tiers' contents) to `directory`; None when a step failed
        before it gave the buffers back (nothing can be written then) or the write failed (logged; a shutdown must
        not fail for want of disk space)."""
        if self.manager.buffers is None:
            logger.warning("the prefix cache is not written to %s: a step failed before it returned the cache's "
                           "buffers", directory)
            return None
        self.flush_transfers()
        try:
            path = save_prefix_cache(directory, self.manager, self.host_buffers, fingerprint)
        except OSError as e:     # a full disk, a read-only or vanished directory: the write is atomic, the old file stays
            logger.error("the prefix cache could not be written to %s (%s); the file there, if any, is kept as it "
                         "was", directory, e.strerror or e)
            return None
        logger.info("prefix cache written to %s (%d bytes)", path, path.stat().st_size)
        return path

    def _load(self, directory: str, fingerprint: dict) -> None:
        """Loads a cache file written for the same fingerprint into the host tier (docs/cache.md, Persistence)."""
        blocks, snapshots = load_prefix_cache(directory, self.manager, self.host_buffers, fingerprint)
        if blocks:
            logger.info("prefix cache: %d KV blocks and %d snapshots loaded from %s into the host tier", blocks,
                        snapshots, Path(directory))
