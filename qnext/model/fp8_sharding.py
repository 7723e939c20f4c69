"""Tensor parallelism over kept FP8 weights (fp8_weight.Fp8Weight): the values and their block scales are
re-ordered and split along the same axis, so each device holds whole 128-blocks with their own scales.

A re-ordering that cuts a block (a device's part, a fused segment or a replicated head not a whole number of blocks
along the split axis) would leave two devices sharing one scale for values they hold apart: refused with a
ValueError naming the tensor and the TP size. The fix is fp8_weights="dequantize" (the weights widened at load and
split as bf16) or a TP size whose parts are whole blocks.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from qnext.ops.fp8_weight import Fp8Weight


def block_along(leaf: Fp8Weight, axis: int) -> int:
    """The block length along `axis` (1 along leading dims such as an expert stack's E)."""
    ndim = len(leaf.shape)
    return leaf.block_size[axis - ndim + 2] if axis >= ndim - 2 else 1


def reorder_fp8(leaf: Fp8Weight, axis: int, segments: list[int], pieces: list[int],
                reorder: Callable[[np.ndarray, int, list[int], int], np.ndarray], *, name: str, tp: int) -> Fp8Weight:
    """`reorder(x, axis, sizes, first)` (tensor_parallel's device-major split or head repetition of the fused
    segments `sizes`, the first of them segment number `first`) applied to the values and, in block units, to the
    scales. pieces[j]: the length of segment j's parts (a device's, a head's), which must be whole blocks. A bf16
    tail (fp8_weight.py) is the last segments along the rows: re-ordered apart, so each device holds its fp8 rows
    and its tail rows, in the model's order once the tail is appended."""
    b = block_along(leaf, axis)
    k = len(segments)
    rows_axis = axis == len(leaf.shape) - 2
    if leaf.tail is not None and rows_axis:   # the segments that make up the fp8 rows
        ends = list(np.cumsum(segments))
        k = ends.index(leaf.q.shape[axis]) + 1 if leaf.q.shape[axis] in ends else -1
        if k < 0:
            raise ValueError(f"weight {name}: its fp8 rows ({leaf.q.shape[axis]}) do not end on a fused segment "
                             f"boundary ({segments}); load it with fp8_weights='dequantize'")
    bad = [n for n in list(segments[:k]) + list(pieces[:k]) if n % b]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={tp} would cut an fp8 block of weight {name}: blocks of {b} along its axis {axis} "
            f"(shape {leaf.shape}), but a device's part or fused segment is {bad[0]} long; load it with "
            "fp8_weights='dequantize' or pick a tensor_parallel_size whose parts are whole blocks")
    q = np.asarray(leaf.q)
    values = reorder(q.view(np.uint8), axis, list(segments[:k]), 0).view(q.dtype)
    scales = reorder(np.asarray(leaf.scale_inv), axis, [n // b for n in segments[:k]], 0)
    tail = leaf.tail
    if tail is not None:
        tail = (reorder(np.asarray(tail), axis, list(segments[k:]), k) if rows_axis
                else reorder(np.asarray(tail), axis, list(segments), 0))
    return Fp8Weight(values, scales, leaf.block_size, tail)
