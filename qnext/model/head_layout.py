"""Fused weight rows laid out for tensor-parallel devices at load (qnext/model/tensor_parallel.py): segments re-ordered
device-major (device r's part of every segment together), and heads that the devices share repeated in place
(tensor_parallel.replicate_heads says which).
Host numpy (and kept-fp8 weights, block by block: qnext/model/fp8_sharding.py); nothing here runs on a device."""
from __future__ import annotations

import numpy as np

from qnext.model.fp8_sharding import reorder_fp8
from qnext.ops.fp8_weight import Fp8Weight


def device_major(x, axis: int, segments: list[int], tp: int, name: str = ""):
    """Re-orders the fused segments along `axis` so that the r-th 1/tp of the axis holds every segment's r-th part."""
    if isinstance(x, Fp8Weight):
        return reorder_fp8(x, axis, segments, [n // tp for n in segments],
                           lambda a, ax, seg, first: device_major(a, ax, seg, tp), name=name, tp=tp)
    parts = np.split(x, np.cumsum(segments)[:-1], axis=axis)
    per_device = [np.split(p, tp, axis=axis) for p in parts]
    return np.concatenate([per_device[j][r] for r in range(tp) for j in range(len(parts))], axis=axis)


def repeat_heads(x, axis: int, segments: list[int], repeats: list[int], name: str = "", tp: int = 1):
    """Fused segments along `axis`, each segment j's heads (rows of its size / heads) repeated repeats[j] times in
    place (head h -> copies h, h, ...), given as repeats[j] = (heads, times)."""
    if isinstance(x, Fp8Weight):
        heads = [n // h if times > 1 else n for n, (h, times) in zip(segments, repeats)]
        return reorder_fp8(x, axis, segments, heads, lambda a, ax, seg, first: repeat_heads(
            a, ax, seg, repeats[first:first + len(seg)]), name=name, tp=tp)
    parts = np.split(x, np.cumsum(segments)[:-1], axis=axis)
    out = []
    for part, (heads, times) in zip(parts, repeats):
        if times > 1:
            shape = part.shape
            part = part.reshape(shape[:axis] + (heads, shape[axis] // heads) + shape[axis + 1:])
            part = np.repeat(part, times, axis=axis)
            part = part.reshape(shape[:axis] + (shape[axis] * times,) + shape[axis + 1:])
        out.append(part)
    return np.concatenate(out, axis=axis)
