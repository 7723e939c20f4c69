"""StepInputs: one flat ragged batch for the model step, and the host-side builder that lays it out.

The flat batch holds every scheduled sequence's new tokens. The model sees it twice (docs/CONTRACTS.md):
a decode view (groups of one token) and a prefill view (groups of up to `chunk` tokens of one sequence, cut at
every snapshot capture position so that a group's end state is exactly the state after its last token).
Padding points at dummy KV block 0 and the zero state row 0 (whose writes are dropped), masked by group lengths.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class RowGroups:
    token_index: jnp.ndarray   # [N, L] int32 flat token index (padding rows: 0, masked by length)
    length: jnp.ndarray        # [N] int32 valid rows
    block_table: jnp.ndarray   # [N, MB] int32 the group's sequence's KV blocks
    kv_len: jnp.ndarray        # [N] int32 sequence length after this step
    is_first: jnp.ndarray      # [N] bool first group of its segment: start from read_row
    is_last: jnp.ndarray       # [N] bool last group of its segment: end state -> write_row
    read_row: jnp.ndarray      # [N] int32 state row to start from; -1 = zero state
    write_row: jnp.ndarray     # [N] int32 live state row
    capture_row: jnp.ndarray   # [N] int32 snapshot row for this group's end state; 0 = none


@struct.dataclass
class StepInputs:
    token_ids: jnp.ndarray     # [T] int32
    positions: jnp.ndarray     # [T] int32
    slot_mapping: jnp.ndarray  # [T] int32 flat KV slot (block * block_size + offset); padding -> 0
    decode: RowGroups          # L = 1
    prefill: RowGroups         # L = chunk
    token_source: jnp.ndarray  # [T] int32 row of concat(decode rows, prefill rows) holding token t
    logits_index: jnp.ndarray  # [M] int32 flat tokens whose logits the step returns
    # Images and video (qnext/vision; None for text only, which then traces exactly as without them):
    rope_positions: jnp.ndarray | None = None      # [T] or [3, T] int32 RoPE positions (3-D: MRoPE t, h, w) where
                                                   # they differ from `positions` (which stay the token indices
                                                   # that place KV and mask attention)
    visual_embeds: jnp.ndarray | None = None       # [N, H] the tower's output for image / video pad tokens
    visual_token_index: jnp.ndarray | None = None  # [N] int32 flat token each row replaces the embedding of;
                                                   # padding rows: T (out of range, dropped)
    lora_slots: jnp.ndarray | None = None          # [T] int32 each token's LoRA adapter slot (0: none); None in
                                                   # an engine without LoRA (qnext/ops/lora_weight.py)


@dataclasses.dataclass
class Segment:
    """One sequence's work in a step: tokens [start, start + len(token_ids)) of the sequence."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    read_row: int                          # -1: zero state (nothing computed before `start`)
    write_row: int
    captures: dict[int, int] = dataclasses.field(default_factory=dict)  # position p -> row (state after p tokens)
    all_logits: bool = False               # logits for every new token (scoring) instead of the last only
    lora_slot: int = 0                     # the sequence's LoRA adapter slot on device (0: none)


@dataclasses.dataclass(frozen=True)
class LayoutSizes:
    num_tokens: int
    num_decode: int
    num_chunks: int
    max_blocks: int
    num_logits: int

    def fits(self, other: "LayoutSizes") -> bool:
        return all(getattr(self, f.name) >= getattr(other, f.name) for f in dataclasses.fields(self))


def _is_decode(seg: Segment) -> bool:
    return len(seg.token_ids) == 1


def group_bounds(start: int, end: int, captures, chunk: int) -> list[tuple[int, int]]:
    """Cut [start, end) into groups of <= chunk tokens, also cut at every capture position."""
    cuts = sorted(p for p in captures if start < p < end)
    bounds, lo = [], start
    for stop in cuts + [end]:
        while stop - lo > chunk:
            bounds.append((lo, lo + chunk))
            lo += chunk
        if stop > lo:
            bounds.append((lo, stop))
            lo = stop
    return bounds


def _group_bounds(seg: Segment, chunk: int) -> list[tuple[int, int]]:
    return group_bounds(seg.start, seg.start + len(seg.token_ids), seg.captures, chunk)


def _check_segment(seg: Segment, block_size: int) -> None:
    end = seg.start + len(seg.token_ids)
    if not seg.token_ids:
        raise ValueError("a segment needs at least one token")
    if len(seg.block_table) * block_size < end:
        raise ValueError(f"block table of {len(seg.block_table)} blocks cannot hold {end} tokens")
    for p in seg.captures:
        if not seg.start < p <= end:
            raise ValueError(f"capture position {p} is outside the segment ({seg.start}, {end}]")


def required_sizes(segments: Sequence[Segment], chunk: int) -> LayoutSizes:
    return LayoutSizes(
        num_tokens=sum(len(s.token_ids) for s in segments),
        num_decode=sum(1 for s in segments if _is_decode(s)),
        num_chunks=sum(len(_group_bounds(s, chunk)) for s in segments if not _is_decode(s)),
        max_blocks=max((len(s.block_table) for s in segments), default=1),
        num_logits=sum(len(s.token_ids) if s.all_logits else 1 for s in segments),
    )


class _Groups:
    """Host numpy buffers for one RowGroups view."""

    def __init__(self, n: int, length: int, max_blocks: int):
        self.token_index = np.zeros((n, length), np.int32)
        self.length = np.zeros(n, np.int32)
        self.block_table = np.zeros((n, max_blocks), np.int32)
        self.kv_len = np.zeros(n, np.int32)
        self.is_first = np.ones(n, bool)
        self.is_last = np.zeros(n, bool)
        self.read_row = np.full(n, -1, np.int32)
        self.write_row = np.zeros(n, np.int32)
        self.capture_row = np.zeros(n, np.int32)
        self.count = 0

    def add(self, flat_lo, lo, hi, seg: Segment, first: bool, last: bool, kv_len: int) -> int:
        i = self.count
        self.count += 1
        self.token_index[i, :hi - lo] = np.arange(flat_lo, flat_lo + hi - lo)
        self.length[i] = hi - lo
        self.block_table[i, :len(seg.block_table)] = seg.block_table
        self.kv_len[i] = kv_len
        self.is_first[i], self.is_last[i] = first, last
        self.read_row[i] = seg.read_row if first else -1
        self.write_row[i] = seg.write_row
        self.capture_row[i] = seg.captures.get(hi, 0)
        return i

    def add_decode_rows(self, flat: np.ndarray, segments: Sequence[Segment]) -> None:
        """`add` for one-token segments at flat indices `flat`, all at once (the first rows of this view)."""
        m = len(segments)
        assert self.count == 0 and m <= len(self.length)
        start = np.fromiter((seg.start for seg in segments), np.int64, m)
        self.token_index[:m, 0] = flat
        self.length[:m] = 1
        for i, seg in enumerate(segments):
            self.block_table[i, :len(seg.block_table)] = seg.block_table
        self.kv_len[:m] = start + 1
        self.is_first[:m] = True
        self.is_last[:m] = True
        self.read_row[:m] = [seg.read_row for seg in segments]
        self.write_row[:m] = [seg.write_row for seg in segments]
        self.capture_row[:m] = [seg.captures.get(p + 1, 0) for seg, p in zip(segments, start.tolist())]
        self.count = m

    def arrays(self) -> RowGroups:
        return RowGroups(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RowGroups)})


def build_step_inputs(segments: Sequence[Segment], sizes: LayoutSizes, *, block_size: int,
                      chunk: int, with_lora: bool = False) -> StepInputs:
    """Lays out the segments into padded arrays of `sizes` (which must fit `required_sizes`). with_lora: the
    inputs carry each token's segment's lora_slot (padding tokens: slot 0)."""
    for seg in segments:
        _check_segment(seg, block_size)
    need = required_sizes(segments, chunk)
    if not sizes.fits(need):
        raise ValueError(f"layout sizes {sizes} are smaller than required {need}")
    t = sizes.num_tokens
    token_ids = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slot_mapping = np.zeros(t, np.int32)
    token_source = np.zeros(t, np.int32)
    lora_slots = np.zeros(t, np.int32) if with_lora else None
    logits_index = np.zeros(sizes.num_logits, np.int32)
    decode = _Groups(sizes.num_decode, 1, sizes.max_blocks)
    prefill = _Groups(sizes.num_chunks, chunk, sizes.max_blocks)

    flat = n_logits = 0
    decode_flat, decode_segs = [], []       # decode rows are laid out together below (vectorised: 64 rows ~4x cheaper)
    for seg in segments:
        n = len(seg.token_ids)
        if _is_decode(seg):
            decode_flat.append(flat)
            decode_segs.append(seg)
            logits_index[n_logits] = flat
            n_logits += 1
            flat += 1
            continue
        end = seg.start + n
        pos = np.arange(seg.start, end)
        token_ids[flat:flat + n] = seg.token_ids
        if with_lora:
            lora_slots[flat:flat + n] = seg.lora_slot
        positions[flat:flat + n] = pos
        table = np.asarray(seg.block_table, np.int64)
        slot_mapping[flat:flat + n] = table[pos // block_size] * block_size + pos % block_size
        bounds = _group_bounds(seg, chunk)
        for j, (lo, hi) in enumerate(bounds):
            g = prefill.add(flat + lo - seg.start, lo, hi, seg, j == 0, j == len(bounds) - 1, end)
            token_source[flat + lo - seg.start:flat + hi - seg.start] = (
                sizes.num_decode + g * chunk + np.arange(hi - lo))
        wanted = np.arange(flat, flat + n) if seg.all_logits else np.array([flat + n - 1])
        logits_index[n_logits:n_logits + len(wanted)] = wanted
        n_logits += len(wanted)
        flat += n
    if decode_segs:
        idx, rows = np.asarray(decode_flat), np.arange(len(decode_segs))   # flat token of decode row i
        decode.add_decode_rows(idx, decode_segs)
        pos = decode.kv_len[rows] - 1
        token_ids[idx] = [seg.token_ids[0] for seg in decode_segs]
        positions[idx] = pos
        slot_mapping[idx] = decode.block_table[rows, pos // block_size] * block_size + pos % block_size
        token_source[idx] = rows
        if with_lora:
            lora_slots[idx] = [seg.lora_slot for seg in decode_segs]

    # Host numpy leaves: the jitted step's C++ dispatch transfers them (~3x cheaper than a device_put here).
    return StepInputs(
        token_ids=token_ids, positions=positions, slot_mapping=slot_mapping, decode=decode.arrays(),
        prefill=prefill.arrays(), token_source=token_source, logits_index=logits_index,
        lora_slots=lora_slots)
