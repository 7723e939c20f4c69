"""Dense projections against weights kept in the checkpoint's nn.Linear layout [out, in]."""
from __future__ import annotations

from jax import lax


def linear(x, w, preferred_element_type=None):
    """x [..., in] with w [out, in] -> [..., out], i.e. x @ w^T.

    Computed as (w @ x^T)^T. XLA:CPU runs this form of the GEMM up to 2x faster than x @ w[in, out] at decode row
    counts (the bench's small model, every weight once at 16 rows: 50 -> 27 ms) and no slower at prefill sizes; the
    transpose only touches the [out, rows] result. Accumulation follows jnp.dot (preferred_element_type to widen)."""
    lead = x.shape[:-1]
    y = lax.dot_general(w, x.reshape(-1, x.shape[-1]), (((1,), (1,)), ((), ())),
                        preferred_element_type=preferred_element_type)
    return y.T.reshape(*lead, w.shape[0])
