"""Step shapes: the fixed set of padded layouts the jitted step is compiled for, and the pick for a step.

Decode-only steps use D rows for D in powers of two from 1 up to max_num_seqs. Steps with a prefill use T tokens
(powers of two from 16 up to max_num_batched_tokens, 1.5x powers of two from 48, and 1.25x / 1.75x powers of two
from 320, so padding costs at most 1.33x, and at most 1.2x where it costs whole milliseconds of matmuls:
docs/engine.md) with ceil(T / C) + extra prefill groups (C = min(prefill_chunk, T) rounded down to a power of
two, as the GPU kernels need), either prefill-only or mixed with decode rows. The scheduler keeps running totals
of a step (StepLayout) and stops adding work when no shape holds it; the runner lays a step out in `bucket_for`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from qnext.model.step_inputs import LayoutSizes, Segment, group_bounds, required_sizes

# Decode layouts start at one row: a batch-1 step's projections then run as matrix-vector products, which XLA:CPU
# streams at the memory's rate (2 rows took the GEMM path: the small model's step ~19 -> ~14 ms; docs/bench/notes.md).
MIN_DECODE_ROWS = 1


@dataclasses.dataclass(frozen=True)
class Bucket:
    sizes: LayoutSizes
    chunk: int                     # prefill group length (the delta rule's chunk)

    @property
    def is_decode(self) -> bool:
        return self.sizes.num_chunks == 0


def powers_of_two(lo: int, hi: int) -> list[int]:
    """Powers of two in [lo, hi), then the first one >= hi."""
    out, n = [], 1
    while n < hi:
        if n >= lo:
            out.append(n)
        n *= 2
    return out + [n]


def prefill_token_sizes(max_num_batched_tokens: int) -> list[int]:
    powers = powers_of_two(16, max_num_batched_tokens)
    halfway = [3 * t // 2 for t in powers if 32 <= t and 3 * t // 2 < powers[-1]]
    quarters = [q * t // 4 for t in powers for q in (5, 7) if 256 <= t and q * t // 4 < powers[-1]]
    return sorted(powers + halfway + quarters)


class BucketTable:
    """Every compiled shape of an engine: decode, prefill-only and mixed families, cheapest first in each."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int, prefill_chunk: int,
                 max_prefill_groups_extra: int):
        self.max_blocks = max_blocks
        self.decode = [Bucket(LayoutSizes(d, d, 0, max_blocks, d), prefill_chunk)
                       for d in powers_of_two(MIN_DECODE_ROWS, max(MIN_DECODE_ROWS, max_num_seqs))]
        self.prefill, self.mixed = [], []
        for t in prefill_token_sizes(max_num_batched_tokens):
            chunk = min(prefill_chunk, 1 << (t.bit_length() - 1))
            groups = -(-t // chunk) + min(max(2, t // 64), max_prefill_groups_extra)
            self.prefill.append(Bucket(LayoutSizes(t, 0, groups, max_blocks, min(groups, max_num_seqs)), chunk))
            if max_num_seqs > 1:                  # one sequence never mixes decode and prefill in a step
                rows = min(max(2, t // 2), max_num_seqs)
                self.mixed.append(Bucket(LayoutSizes(t, rows, groups, max_blocks, min(rows + groups, max_num_seqs)),
                                         chunk))

    @property
    def all(self) -> list[Bucket]:
        return self.decode + self.prefill + self.mixed

    def bucket_for(self, segments: Sequence[Segment]) -> Bucket | None:
        """The cheapest shape that holds the segments (families in the order decode, prefill, mixed)."""
        need = {}                                 # required sizes per chunk length: buckets share a few
        for b in self.all:
            if b.chunk not in need:
                need[b.chunk] = required_sizes(segments, b.chunk)
            if b.sizes.fits(need[b.chunk]):
                return b
        return None

    def new_layout(self) -> "StepLayout":
        return StepLayout(self)


class StepLayout:
    """Running totals of the step being scheduled: `try_add` keeps a piece of work only if the step still fits a
    compiled shape. Totals are additive (every bucket's block table spans max_model_len), so a check costs
    O(buckets)."""

    def __init__(self, table: BucketTable):
        self.table = table
        self.tokens = self.decode = self.segments = 0
        self.groups = {b.chunk: 0 for b in table.prefill}
        self.all_decode = True

    def try_add(self, start: int, num_tokens: int, capture_positions: Sequence[int]) -> bool:
        decode = num_tokens == 1
        groups = {c: n + (0 if decode else len(group_bounds(start, start + num_tokens, capture_positions, c)))
                  for c, n in self.groups.items()}
        tokens, num_decode, segments = self.tokens + num_tokens, self.decode + decode, self.segments + 1
        all_decode = self.all_decode and decode
        fits = all_decode and any(b.sizes.num_decode >= num_decode for b in self.table.decode)
        fits = fits or any(b.sizes.num_tokens >= tokens and b.sizes.num_decode >= num_decode
                           and b.sizes.num_chunks >= groups[b.chunk] and b.sizes.num_logits >= segments
                           for b in self.table.prefill + self.table.mixed)
        if fits:
            self.tokens, self.decode, self.segments, self.all_decode = tokens, num_decode, segments, all_decode
            self.groups = groups
        return fits


def scoring_sizes(num_tokens: int, *, chunk: int, block_size: int) -> LayoutSizes:
    """The layout that scores one sequence of num_tokens with logits for every token: tokens padded to a power
    of two (>= 16, so few shapes compile). A one-token sequence is a decode row, and decode layouts have
    MIN_DECODE_ROWS rows."""
    padded = max(16, 1 << (num_tokens - 1).bit_length())
    return LayoutSizes(num_tokens=padded, num_decode=MIN_DECODE_ROWS if num_tokens == 1 else 0,
                       num_chunks=-(-padded // chunk), max_blocks=-(-padded // block_size), num_logits=padded)
