"""The device side of forks (cache/forks.py): one jitted call copies state rows and KV blocks inside the cache's
buffers (donated), for every layer at once. Index vectors are padded to powers of two (few shapes compile); padded
entries read row / block 0 and write out of range, which is dropped (the zero row and dummy block stay as they are).
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from cache.device_buffers import CacheBuffers
from cache.forks import ForkCopies


def _padded(src: list[int], dst: list[int], out_of_range: int) -> tuple[np.ndarray, np.ndarray]:
    size = 1 << max(0, len(dst) - 1).bit_length()
    s, d = np.zeros(size, np.int32), np.full(size, out_of_range, np.int32)
    s[:len(src)], d[:len(dst)] = src, dst
    return s, d


@functools.partial(jax.jit, donate_argnums=0)
def _copy(buffers: CacheBuffers, src_rows, dst_rows, src_blocks, dst_blocks) -> CacheBuffers:
    # all reads happen before any write: a functional gather of the old buffers, then the scatter
    def rows(x):                     # [R, ...]
        return x.at[dst_rows].set(x[src_rows], mode="drop")

    def blocks(x):                   # [Hkv, num_blocks, block_size, D]
        return x.at[:, dst_blocks].set(x[:, src_blocks], mode="drop")

    return CacheBuffers(kv=tuple((blocks(k), blocks(v)) for k, v in buffers.kv),
                        conv=tuple(rows(c) for c in buffers.conv),
                        recurrent=tuple(rows(r) for r in buffers.recurrent))


def apply_fork_copies(copies: ForkCopies, buffers: CacheBuffers) -> CacheBuffers:
    """Runs the queued fork copies on the buffers (donated) -> the new buffers."""
    if not copies:
        return buffers
    num_rows = buffers.conv[0].shape[0] if buffers.conv else 1
    num_blocks = buffers.kv[0][0].shape[1] if buffers.kv else 1
    src_rows, dst_rows = _padded(copies.src_rows, copies.dst_rows, num_rows)
    src_blocks, dst_blocks = _padded(copies.src_blocks, copies.dst_blocks, num_blocks)
    return _copy(buffers, src_rows, dst_rows, src_blocks, dst_blocks)
