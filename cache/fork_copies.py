"""The device side of forks (cache/forks.py): one jitted call copies state rows and KV blocks inside the cache's
buffers (donated), for every layer at once. Index vectors are padded to a power of two (the blocks' to the rows'
size, or 1 when no block is copied), so few shapes compile and `warm_up_fork_copies` compiles them all; padded
entries read row / block 0 and write out of range, which is dropped (the zero row and dummy block stay as they are).
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from cache.device_buffers import CacheBuffers, page_index
from cache.forks import ForkCopies


def _size(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _padded(src: list[int], dst: list[int], out_of_range: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    s, d = np.zeros(size, np.int32), np.full(size, out_of_range, np.int32)
    s[:len(src)], d[:len(dst)] = src, dst
    return s, d


@functools.partial(jax.jit, donate_argnums=0)
def _copy(buffers: CacheBuffers, src_rows, dst_rows, src_blocks, dst_blocks) -> CacheBuffers:
    # all reads happen before any write: a functional gather of the old buffers, then the scatter
    def rows(x):                     # [R, ...]
        return x.at[dst_rows].set(x[src_rows], mode="drop")

    def blocks(x):                   # [Hkv, num_blocks, block_size, D]
        return x.at[page_index(x, dst_blocks)].set(x[page_index(x, src_blocks)], mode="drop")

    return CacheBuffers(kv=tuple((blocks(k), blocks(v)) for k, v in buffers.kv),
                        conv=tuple(rows(c) for c in buffers.conv),
                        recurrent=tuple(rows(r) for r in buffers.recurrent))


def apply_fork_copies(copies: ForkCopies, buffers: CacheBuffers) -> CacheBuffers:
    """Runs the queued fork copies on the buffers (donated) -> the new buffers."""
    if not copies:
        return buffers
    num_rows = buffers.conv[0].shape[0] if buffers.conv else 1
    num_blocks = buffers.kv[0][0].shape[1] if buffers.kv else 1
    size = _size(max(len(copies.dst_rows), len(copies.dst_blocks)))      # blocks: the rows' size, or 1 if none
    src_rows, dst_rows = _padded(copies.src_rows, copies.dst_rows, num_rows, size)
    src_blocks, dst_blocks = _padded(copies.src_blocks, copies.dst_blocks, num_blocks,
                                     size if copies.dst_blocks else 1)
    return _copy(buffers, src_rows, dst_rows, src_blocks, dst_blocks)


def warm_up_fork_copies(buffers: CacheBuffers, max_forks: int) -> CacheBuffers:
    """Compiles every copy shape up to max_forks forks at once (rows and blocks padded to the same power of two,
    or no block: a prompt that ends on a block boundary) on copies that write nothing."""
    num_rows = buffers.conv[0].shape[0] if buffers.conv else 1
    num_blocks = buffers.kv[0][0].shape[1] if buffers.kv else 1
    size = 1
    while True:
        for blocks in {size, 1}:
            buffers = _copy(buffers, np.zeros(size, np.int32), np.full(size, num_rows, np.int32),
                            np.zeros(blocks, np.int32), np.full(blocks, num_blocks, np.int32))
        if size >= max_forks:
            return buffers
        size *= 2
