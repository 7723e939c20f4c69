"""Forks: several sequences continuing one prompt (parallel sampling, `n > 1`); the cache manager holds a `Forks`.

A request with n samples is admitted once, as its first sample, with `num_forks = n - 1` live rows and (when the
prompt ends inside a block) n - 1 blocks reserved at admission, so a fork can never fail and never evicts anything
after the prompt's step has run. When that step has been committed, `fork(parent, child)` makes each child:
- KV: the prompt's full blocks shared by reference (ref count + 1; the prompt is published once, by the parent, and
  the child's chain is the parent's), the partial last block copied into a reserved block (copy on write: each
  sample writes its own tokens after the prompt there);
- state: the parent's live row (the recurrent + conv state after the whole prompt) copied into a reserved live row.
The copies are queued here and taken by the manager's `take_fork_copies()`; the scheduler runs them all as one
batched device copy (`apply_fork_copies`, cache/fork_buffer_copies.py) when it next lends the buffers, before the copies
between tiers and before any step: the sources (the parent's row and partial block) are then still as the prompt's
step left them, even if the parent finished or was preempted in between (a row or block handed to someone else is
written only by a later step or a later tier load), and the reserved destinations' own evictions were copied out at
an earlier lend.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cache.block_pool import BlockPool
from cache.records import SequenceRecord


@dataclass
class ForkCopies:
    """Copies to run inside the device buffers: state rows src -> dst, KV blocks src -> dst (all layers)."""

    src_rows: list[int] = field(default_factory=list)
    dst_rows: list[int] = field(default_factory=list)
    src_blocks: list[int] = field(default_factory=list)
    dst_blocks: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.dst_rows or self.dst_blocks)

    def drop_targets(self, rows: set[int], blocks: set[int]) -> None:
        """Forget copies into rows / blocks released before the copies ran."""
        kept_rows = [(s, d) for s, d in zip(self.src_rows, self.dst_rows) if d not in rows]
        kept_blocks = [(s, d) for s, d in zip(self.src_blocks, self.dst_blocks) if d not in blocks]
        self.src_rows, self.dst_rows = [s for s, _ in kept_rows], [d for _, d in kept_rows]
        self.src_blocks, self.dst_blocks = [s for s, _ in kept_blocks], [d for _, d in kept_blocks]


class Forks:
    """The cache manager's fork bookkeeping: the reserves a parent takes at admission, the child's record at a fork,
    and the copies queued for the next lend of the buffers."""

    def __init__(self, block_size: int, blocks: BlockPool):
        self.block_size = block_size
        self.blocks = blocks
        self._copies = ForkCopies()

    def needs(self, prompt_len: int, num_forks: int) -> tuple[int, int]:
        """(live rows, blocks) that num_forks forks of a prompt of prompt_len tokens take."""
        return num_forks, num_forks if prompt_len % self.block_size else 0

    def reserve(self, seq: SequenceRecord, rows: list[int]) -> None:
        """Gives a parent its reserves: the live rows (one per fork) and, when its prompt ends inside a block,
        a block per fork for the copy of that partial block. The manager checked that they can be had."""
        seq.fork_rows = rows
        blocks = self.needs(seq.prompt_len, len(rows))[1]
        seq.fork_blocks = self.blocks.allocate(blocks) if blocks else []

    def fork(self, parent: SequenceRecord) -> SequenceRecord:
        """The record of a copy of `parent` after its whole prompt (its step committed): shared full blocks, a copied
        partial block and a copied state row, from the parent's reserves. The child decodes from its own row."""
        bs, n = self.block_size, parent.prompt_len
        full = n // bs
        shared = parent.block_table[:full]
        self.blocks.acquire(shared)
        chain = list(parent.chain[:full])
        self.blocks.acquire([c for c, own in zip(chain, shared) if c != own])     # twin originals, as the parent
        row = parent.fork_rows.pop()
        table = list(shared)
        copies = self._copies
        copies.src_rows.append(parent.state_row)
        copies.dst_rows.append(row)
        if n % bs:
            block = parent.fork_blocks.pop()
            copies.src_blocks.append(parent.block_table[full])
            copies.dst_blocks.append(block)
            table.append(block)
        return SequenceRecord(prompt_len=n, hashes=list(parent.hashes[:full]), block_table=table, state_row=row,
                              num_cached_tokens=0, chain=chain, ran=True, cacheable=parent.cacheable,
                              images=parent.images, hash_root=parent.hash_root)

    def take_copies(self) -> ForkCopies:
        copies, self._copies = self._copies, ForkCopies()
        return copies

    def release(self, seq: SequenceRecord) -> list[int]:
        """At free: releases the blocks no fork used and forgets the copies into this sequence's row and fork block
        that have not run yet. Returns the reserved live rows no fork used, for the manager to take back."""
        rows = seq.fork_rows
        self.blocks.release(seq.fork_blocks)
        seq.fork_rows, seq.fork_blocks = [], []
        if self._copies:
            self._copies.drop_targets({seq.state_row}, set(seq.block_table))
        return rows
