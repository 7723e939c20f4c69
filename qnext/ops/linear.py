"""Dense projections against weights kept in the checkpoint's nn.Linear layout [out, in]."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from qnext.ops.fp8_weight import Fp8Weight
from qnext.ops.lora_weight import LoraWeight, lora_delta

SPLIT_MAX_ROWS = 32      # CPU: up to this many rows, the output halves run as one batched dot (below)


def linear(x, w, preferred_element_type=None):
    """x [..., in] with w [out, in] -> [..., out], i.e. x @ w^T.

    Computed as (w @ x^T)^T. XLA:CPU runs this form of the GEMM up to 2x faster than x @ w[in, out] at decode row
    counts (the bench's small model, every weight once at 16 rows: 50 -> 27 ms) and no slower at prefill sizes; the
    transpose only touches the [out, rows] result. On CPU, with 1-32 rows, w is viewed as two halves of its output
    rows [2, out/2, in] (a free reshape) and multiplied as one batched dot: XLA:CPU then streams the two halves on
    both cores, where one skinny dot runs on one (the small model's weights: 2 rows 21.7 -> 15.1 ms, 16 rows
    24.6 -> 19.5 ms; no gain at 64 rows, slower from 128). One row (a batch-1 decode step) becomes two
    matrix-vector products run at once, at the memory's rate (~31-33 GB/s here, 10.4 -> 9.9 ms for the small
    model's weights). Each output element is still one dot product over `in`. Accumulation follows jnp.dot
    (preferred_element_type to widen).

    w may be an Fp8Weight (fp8_weights="keep"): Q is widened to x's dtype times its block scales inside the jitted
    step and multiplied as above (fp8_linear.py's "dequantize" form: the same result as the dequantised weight's).

    w may be a LoraWeight (qnext/ops/lora_weight.py): the base projection plus each row's own adapter's delta."""
    if isinstance(w, LoraWeight):
        return linear(x, w.base, preferred_element_type) + lora_delta(x, w, linear).astype(
            preferred_element_type or x.dtype)
    if isinstance(w, Fp8Weight):
        w = w.dequantized(x.dtype)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    out, inner = w.shape
    if 1 <= rows.shape[0] <= SPLIT_MAX_ROWS and out % 2 == 0 and jax.default_backend() == "cpu":
        halves = w.reshape(2, out // 2, inner)
        y = lax.dot_general(halves, jnp.broadcast_to(rows, (2,) + rows.shape), (((2,), (2,)), ((0,), (0,))),
                            preferred_element_type=preferred_element_type).reshape(out, -1)
    else:
        y = lax.dot_general(w, rows, (((1,), (1,)), ((), ())), preferred_element_type=preferred_element_type)
    return y.T.reshape(*lead, out)
