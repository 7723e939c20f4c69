"""Dense projections: every row count (GEMV, the CPU split into output halves, the plain GEMM) is x @ w^T."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.ops.linear import SPLIT_MAX_ROWS, linear


@pytest.mark.parametrize("rows", [1, 2, 5, SPLIT_MAX_ROWS, SPLIT_MAX_ROWS + 1])
@pytest.mark.parametrize("out", [48, 37])                  # odd: no split into halves
def test_linear_is_x_times_w_transposed(rows, out):
    rng = np.random.default_rng(rows * out)
    x = rng.normal(size=(rows, 3, 24)).astype(np.float32)   # leading dims are kept
    w = rng.normal(size=(out, 24)).astype(np.float32)
    got = jax.jit(linear)(jnp.asarray(x), jnp.asarray(w))
    assert got.shape == (rows, 3, out)
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_linear_widens_accumulation_when_asked():
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((6, 8), jnp.bfloat16)
    got = linear(x, w, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32 and np.all(np.asarray(got) == 8.0)
