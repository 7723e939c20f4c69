"""Forks: several sequences continuing one prompt (parallel sampling, `n > 1`), mixed into CacheManager.

A request with n samples is admitted once, as its first sample, with `num_forks = n - 1` live rows and (when the
prompt ends inside a block) n - 1 blocks reserved at admission, so a fork can never fail and never evicts anything
after the prompt's step has run. When that step has been committed, `fork(parent, child)` makes each child:
- KV: the prompt's full blocks shared by reference (ref count + 1; the prompt is published once, by the parent, and
  the child's chain is the parent's), the partial last block copied into a reserved block (copy on write: each
  sample writes its own tokens after the prompt there);
- state: the parent's live row (the recurrent + conv state after the whole prompt) copied into a reserved live row.
The copies are queued here and taken by `take_fork_copies()`; the scheduler runs them all as one batched device
copy (cache/fork_copies.py) when it next lends the buffers, before the copies between tiers and before any step:
the sources (the parent's row and partial block) are then still as the prompt's step left them, even if the parent
finished or was preempted in between (a row or block handed to someone else is written only by a later step or a
later tier load), and the reserved destinations' own evictions were copied out at an earlier lend.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


class ForkSupport:
    """Fork bookkeeping for CacheManager (self.blocks, self._seqs, self._free_slots, self.config)."""

    def _fork_needs(self, prompt_len: int, num_forks: int) -> tuple[int, int]:
        """(live rows, blocks) that num_forks forks of a prompt of prompt_len tokens take."""
        return num_forks, num_forks if prompt_len % self.config.block_size else 0

    def _reserve_forks(self, seq: SequenceRecord, num_forks: int) -> None:
        rows, blocks = self._fork_needs(seq.prompt_len, num_forks)
        seq.fork_rows = [self._free_slots.pop() for _ in range(rows)]
        seq.fork_blocks = self.blocks.allocate(blocks) if blocks else []

    def fork(self, parent_id, child_id) -> None:
        """Makes `child_id` a copy of `parent_id` after its whole prompt (call after the commit of the step that
        computed the prompt's last token): shared full blocks, a copied partial block and a copied state row,
        from the reserves taken at the parent's admission. The child then decodes from its own row."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already admitted")
        if not parent.fork_rows:
            raise ValueError(f"sequence {parent_id!r} has no fork reserved (admit it with num_forks)")
        bs, n = self.config.block_size, parent.prompt_len
        full = n // bs
        shared = parent.block_table[:full]
        self.blocks.acquire(shared)
        chain = list(parent.chain[:full])
        self.blocks.acquire([c for c, own in zip(chain, shared) if c != own])     # twin originals, as the parent
        row = parent.fork_rows.pop()
        table = list(shared)
        copies = self._fork_copies
        copies.src_rows.append(parent.state_row)
        copies.dst_rows.append(row)
        if n % bs:
            block = parent.fork_blocks.pop()
            copies.src_blocks.append(parent.block_table[full])
            copies.dst_blocks.append(block)
            table.append(block)
        self._seqs[child_id] = SequenceRecord(prompt_len=n, hashes=list(parent.hashes[:full]), block_table=table,
                                              state_row=row, num_cached_tokens=0, chain=chain, ran=True,
                                              cacheable=parent.cacheable)
        self._track_peaks()

    def take_fork_copies(self) -> ForkCopies:
        copies, self._fork_copies = self._fork_copies, ForkCopies()
        return copies

    def _release_forks(self, seq: SequenceRecord) -> None:
        """At free: the reserves no fork used, and the copies into this sequence's row and fork block if they
        have not run yet."""
        self._free_slots.extend(seq.fork_rows)
        self.blocks.release(seq.fork_blocks)
        seq.fork_rows, seq.fork_blocks = [], []
        if self._fork_copies:
            self._fork_copies.drop_targets({seq.state_row}, set(seq.block_table))
