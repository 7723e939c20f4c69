"""fp8_weights="keep": a checkpoint leaf built from fp8 tensors kept as e4m3 with block scales (fp8_weight.Fp8Weight)
instead of dequantised.

The loader combines a leaf's HF tensors by re-ordering rows (concatenating q | gate | k | v, de-interleaving
Qwen3-Next's per-key-head qkvz, stacking gate | up). The same re-ordering is applied to the e4m3 bytes, and each
output block of b0 rows takes the scale row of the one source block all its rows come from. When the rows of one
output block come from two source blocks (a head of fewer than b0 rows re-ordered, a segment boundary inside a
block), no single scale fits: the leaf is dequantised instead (`None`). A leaf that mixes fp8 and bf16 tensors
(Qwen3.5's in_proj: qkv and z fp8, the decay gates b and a bf16) is dequantised too, never mixed: its bf16 rows
would otherwise have to be quantised (the peers' garbled-output bug) or multiplied apart.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from qnext.model.fp8_blocks import e4m3
from qnext.ops.fp8_weight import Fp8Weight

FP8_WEIGHT_MODES = ("dequantize", "keep")


def kept_rows(parts: list[tuple[np.ndarray, np.ndarray | None]], combine: Callable[..., np.ndarray],
              block_size: tuple[int, int], tail_dtype=np.float32) -> Fp8Weight | None:
    """parts: each source's (e4m3 [rows_i, cols], scales [ceil(rows_i/b0), cb]), or (float values, None) for a
    source the release left in bf16; combine: the loader's row re-ordering of the sources -> the leaf as an
    Fp8Weight (the float sources' rows, which must come last, as its `tail` in `tail_dtype`), or None when a block
    would mix two source blocks or float rows are not all at the end."""
    b0 = block_size[0]
    first_block, ids = 0, []
    for p, s in parts:   # each row's global source-block id (-1: a float row), shaped like the source so `combine`
        rows = p.shape[0]  # can move it
        row_ids = first_block + np.arange(rows) // b0 if s is not None else np.full(rows, -1)
        ids.append(np.broadcast_to(row_ids[:, None].astype(np.int32), p.shape).copy())
        first_block += s.shape[0] if s is not None else 0
    row_block = combine(*ids)[:, 0]
    n = int(np.sum(row_block >= 0))
    if n == 0 or np.any(row_block[n:] >= 0):
        return None
    head = row_block[:n]
    starts = head[::b0]
    if not np.array_equal(np.repeat(starts, b0)[:n], head):
        return None
    q = combine(*(np.ascontiguousarray(p).view(np.uint8) if s is not None else np.zeros(p.shape, np.uint8)
                  for p, s in parts))[:n].view(e4m3())
    tail = None
    if n < len(row_block):
        tail = combine(*(np.zeros(p.shape, np.float32) if s is not None else np.asarray(p, np.float32)
                         for p, s in parts))[n:].astype(tail_dtype)
    scales = np.concatenate([s for _, s in parts if s is not None], axis=0)[starts]
    return Fp8Weight(np.ascontiguousarray(q), np.ascontiguousarray(scales, dtype=np.float32), tuple(block_size),
                     tail)


def kept_expert_stack(q: np.ndarray, scale_inv: np.ndarray, block_size: tuple[int, int]) -> Fp8Weight:
    """A fused expert stack [E, out, in] as released -> the grouped matmul's [E, in, out], blocks transposed with it
    (fp8_weight.py)."""
    b0, b1 = block_size
    q = np.ascontiguousarray(np.ascontiguousarray(q).view(np.uint8).transpose(0, 2, 1)).view(e4m3())
    return Fp8Weight(q, np.ascontiguousarray(scale_inv.astype(np.float32).transpose(0, 2, 1)), (b1, b0))


def kept_expert_list(parts: list[tuple[np.ndarray, np.ndarray]], per_expert: int,
                     block_size: tuple[int, int]) -> Fp8Weight | None:
    """Per-expert tensors, `per_expert` parts each in order (gate_j, up_j; or down_j), each expert's parts stacked
    by rows -> the stack as kept_expert_stack makes it; None when an expert's parts cannot keep whole blocks."""
    k = per_expert
    experts = [kept_rows(parts[j:j + k], lambda *xs: np.concatenate(xs, axis=0), block_size)
               for j in range(0, len(parts), k)]
    if any(e is None for e in experts):
        return None
    q = np.stack([np.asarray(e.q).view(np.uint8) for e in experts]).view(e4m3())
    return kept_expert_stack(q, np.stack([e.scale_inv for e in experts]), block_size)
