"""The forks' copies inside the device buffers (cache/forks.py queues them): `apply_fork_copies` copies state rows
and KV blocks, every layer in one jitted call (donated); rows and blocks are padded to the same power of two (blocks
to 1 when none is copied), so `warm_up_fork_copies` compiles every shape; padded entries read row / block 0 and
write out of range (dropped). Forks copy live rows only: a separate snapshot pool passes through."""
from __future__ import annotations

import functools

import jax
import numpy as np

from cache.buffer_copies import next_pow2, padded_indices, page_index
from cache.device_buffers import CacheBuffers
from cache.forks import ForkCopies


def apply_fork_copies(copies: ForkCopies, buffers: CacheBuffers) -> CacheBuffers:
    """Runs the queued fork copies on the buffers (donated) -> the new buffers."""
    if not copies:
        return buffers
    num_rows, num_blocks = _fork_bounds(buffers)
    size = next_pow2(max(len(copies.dst_rows), len(copies.dst_blocks)))      # blocks: the rows' size, or 1 if none
    blocks = size if copies.dst_blocks else 1
    return _fork_copy(buffers, padded_indices(copies.src_rows, 0, size),
                      padded_indices(copies.dst_rows, num_rows, size), padded_indices(copies.src_blocks, 0, blocks),
                      padded_indices(copies.dst_blocks, num_blocks, blocks))


def warm_up_fork_copies(buffers: CacheBuffers, max_forks: int) -> CacheBuffers:
    """Compiles every fork copy shape up to max_forks forks at once (rows and blocks padded to the same power of
    two, or no block: a prompt that ends on a block boundary) on copies that write nothing."""
    num_rows, num_blocks = _fork_bounds(buffers)
    size = 1
    while True:
        for blocks in {size, 1}:
            buffers = _fork_copy(buffers, np.zeros(size, np.int32), np.full(size, num_rows, np.int32),
                                 np.zeros(blocks, np.int32), np.full(blocks, num_blocks, np.int32))
        if size >= max_forks:
            return buffers
        size *= 2


def _fork_bounds(buffers: CacheBuffers) -> tuple[int, int]:
    """(state rows, KV blocks) of the buffers: the out-of-range index of each."""
    return (buffers.conv[0].shape[0] if buffers.conv else 1), (buffers.kv[0][0].shape[1] if buffers.kv else 1)


@functools.partial(jax.jit, donate_argnums=0)
def _fork_copy(buffers: CacheBuffers, src_rows, dst_rows, src_blocks, dst_blocks) -> CacheBuffers:
    # all reads happen before any write: a functional gather of the old buffers, then the scatter
    def rows(x):                     # [R, ...]
        return x.at[dst_rows].set(x[src_rows], mode="drop")

    def blocks(x):                   # [Hkv, num_blocks, block_size, D]
        return x.at[page_index(x, dst_blocks)].set(x[page_index(x, src_blocks)], mode="drop")

    # forks copy live rows (a parent's row into its children's): a separate snapshot pool passes through
    return buffers.replace(kv=tuple((blocks(k), blocks(v)) for k, v in buffers.kv),
                           conv=tuple(rows(c) for c in buffers.conv),
                           recurrent=tuple(rows(r) for r in buffers.recurrent))
