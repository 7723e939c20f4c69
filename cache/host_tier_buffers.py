"""The host tier's arrays and the copies between them and the device buffers (cache/device_buffers.py).

The host tier keeps KV blocks and snapshot rows in numpy arrays laid out like the device buffers
(slot = block / row): per full-attention layer (k, v) [Hkv, num_host_blocks, block_size, D],
per linear-attention layer conv [num_host_snapshots, K-1, conv_dim] and recurrent [num_host_snapshots, Hv, dk, dv]
in the layout's snapshot dtype (float32, or narrower with mamba_ssm_cache_dtype: rounded when saved, widened to
float32 when loaded). `apply` runs a TransferPlan (cache/transfers.py) that the cache manager decided: phase by phase, the
saves (one jitted gather per kind, then one device -> host copy) before the loads (one host gather, one host ->
device copy and one jitted scatter per kind, the device buffers donated), in the bounded shapes of
cache/buffer_copies.py. On CPU the "device" is host memory and the same code is a copy.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from cache.buffer_copies import (MAX_COPY, chunks, gather_blocks, gather_rows, padded_indices, scatter_blocks,
                                 scatter_rows)
from cache.device_buffers import LIVE_PART, POOL_PART, CacheBuffers, CacheLayout, split_rows, state_part
from cache.stats import TierStats
from cache.transfers import TransferPlan


@dataclasses.dataclass
class HostTierBuffers:
    kv: tuple          # per full-attention layer: (k, v), each [Hkv, num_host_blocks, block_size, D] np
    conv: tuple        # per linear-attention layer: [num_host_snapshots, K-1, conv_dim] np
    recurrent: tuple   # per linear-attention layer: [num_host_snapshots, Hv, dk, dv] np, the snapshot dtype

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves((self.kv, self.conv, self.recurrent)))

    def block_bytes(self) -> int:
        return sum(k[:, 0].nbytes + v[:, 0].nbytes for k, v in self.kv)

    def row_bytes(self) -> int:
        return sum(c[0].nbytes + r[0].nbytes for c, r in zip(self.conv, self.recurrent))

    def apply(self, plan: TransferPlan, buffers: CacheBuffers, stats: TierStats) -> CacheBuffers:
        """Runs the plan's copies on `buffers` (donated) and this tier's arrays; returns the new device buffers."""
        for phase in plan.phases:
            t0 = time.perf_counter()
            for slots, blocks in chunks(phase.kv_saves):
                got = jax.device_get(gather_blocks(buffers.kv, padded_indices(blocks, 0)))
                for (k, v), (gk, gv) in zip(self.kv, got):
                    k[:, slots], v[:, slots] = gk[:, :len(slots)], gv[:, :len(slots)]
            for slots, rows in chunks(phase.state_saves):
                for part, at, index in split_rows(buffers, rows):
                    conv, recurrent = jax.device_get(gather_rows(state_part(buffers, part), padded_indices(index, 0)))
                    to = [slots[i] for i in at]
                    for c, r, gc, gr in zip(self.conv, self.recurrent, conv, recurrent):
                        c[to], r[to] = gc[:len(to)], gr[:len(to)]
            t1 = time.perf_counter()
            for blocks, slots in chunks(phase.kv_loads):
                padded = padded_indices(slots, 0)
                values = tuple((k[:, padded], v[:, padded]) for k, v in self.kv)
                kv = scatter_blocks(buffers.kv, padded_indices(blocks, buffers.kv[0][0].shape[1]), values)
                buffers = buffers.replace(kv=kv)
            for rows, slots in chunks(phase.state_loads):
                for part, at, index in split_rows(buffers, rows):
                    padded = padded_indices([slots[i] for i in at], 0)
                    values = (tuple(c[padded] for c in self.conv), tuple(r[padded] for r in self.recurrent))
                    state = state_part(buffers, part)
                    conv, recurrent = scatter_rows(state, padded_indices(index, state[0][0].shape[0]), values)
                    buffers = buffers.replace(**{part[0]: conv, part[1]: recurrent})
            if phase.kv_loads or phase.state_loads:
                jax.block_until_ready(buffers)
            t2 = time.perf_counter()
            block, row = self.block_bytes(), self.row_bytes()
            stats.bytes_to_host += len(phase.kv_saves) * block + len(phase.state_saves) * row
            stats.bytes_to_device += len(phase.kv_loads) * block + len(phase.state_loads) * row
            stats.seconds_to_host += t1 - t0
            stats.seconds_to_device += t2 - t1
        return buffers

    def warm_up(self, buffers: CacheBuffers) -> CacheBuffers:
        """Compiles every copy shape (powers of two up to MAX_COPY) on copies that read block / row 0 and write
        nothing; returns the buffers."""
        num_blocks = buffers.kv[0][0].shape[1]
        parts = [LIVE_PART] + ([POOL_PART] if buffers.first_pool_row is not None else [])
        size = 1
        while size <= MAX_COPY:
            zeros, nowhere = np.zeros(size, np.int32), np.full(size, num_blocks, np.int32)
            if self.kv[0][0].shape[1]:
                jax.block_until_ready(gather_blocks(buffers.kv, zeros))
                values = tuple((k[:, zeros], v[:, zeros]) for k, v in self.kv)
                buffers = buffers.replace(kv=scatter_blocks(buffers.kv, nowhere, values))
            for part in parts if self.conv and self.conv[0].shape[0] else ():
                state = state_part(buffers, part)
                jax.block_until_ready(gather_rows(state, zeros))
                values = (tuple(c[zeros] for c in self.conv), tuple(r[zeros] for r in self.recurrent))
                conv, recurrent = scatter_rows(state, np.full(size, state[0][0].shape[0], np.int32), values)
                buffers = buffers.replace(**{part[0]: conv, part[1]: recurrent})
            size *= 2
        return jax.block_until_ready(buffers)


def allocate_host_buffers(layout: CacheLayout, *, num_blocks: int, block_size: int,
                          num_snapshots: int) -> HostTierBuffers:
    """Zeroed host arrays for `num_blocks` KV blocks and `num_snapshots` snapshot rows (whole, not sharded)."""
    dtype, kv_dtype = jnp.dtype(layout.dtype), jnp.dtype(layout.kv_storage)
    page = (layout.num_kv_heads, num_blocks, block_size, layout.head_dim)
    return HostTierBuffers(
        kv=tuple((np.zeros(page, kv_dtype), np.zeros(page, kv_dtype)) for _ in range(layout.num_kv_layers)),
        conv=tuple(np.zeros((num_snapshots, layout.conv_width - 1, layout.conv_dim), dtype)
                   for _ in range(layout.num_state_layers)),
        recurrent=tuple(np.zeros((num_snapshots, layout.num_v_heads, layout.k_head_dim, layout.v_head_dim),
                                 jnp.dtype(layout.snapshot_dtype)) for _ in range(layout.num_state_layers)))
