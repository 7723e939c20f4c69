"""Paged attention over fp8 (e4m3) KV pages (kv_cache_dtype fp8): the Pallas kernel in interpret mode equals the
reference on the same fp8 pages, both equal attention over the pages widened to float32 (the fp8 values are
exact), and the kernel lowers for CUDA reading e4m3 pages (the Mosaic backend hands fp8 pages to the Triton one)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as ops
from tests.support.kernel_cases import ATTN_CASES, attn_inputs, random_attn_layout

F8 = jnp.float8_e4m3fn


@pytest.mark.parametrize("case, hq, hkv, d, q_dtype", [("decode", 4, 2, 32, np.float32),
                                                       ("mixed", 8, 2, 64, jnp.bfloat16)])
def test_kernel_reads_fp8_pages_like_the_reference(case, hq, hkv, d, q_dtype):
    seqs, group_len = ATTN_CASES[case]
    rng = np.random.default_rng(hq + d)
    layout = random_attn_layout(rng, seqs, group_len, 16, num_pad=1)
    q, k_pages, v_pages = attn_inputs(rng, layout, hq, hkv, d, 16)
    q = jnp.asarray(q, q_dtype)
    k8, v8 = jnp.asarray(k_pages * 4, F8), jnp.asarray(v_pages * 4, F8)     # e4m3 values around 4
    args = (jnp.asarray(layout.block_table), jnp.asarray(layout.kv_len), jnp.asarray(layout.q_pos))
    kernel = ops.paged_attention(q, k8, v8, *args, sm_scale=d ** -0.5 / 4, interpret=True)
    reference = jax.jit(functools.partial(ops.paged_attention, sm_scale=d ** -0.5 / 4, implementation="reference"))
    want = reference(q, k8, v8, *args)
    wide = reference(q, k8.astype(jnp.float32), v8.astype(jnp.float32), *args)
    np.testing.assert_array_equal(np.asarray(want), np.asarray(wide))
    tol = dict(rtol=1e-5, atol=1e-5) if q_dtype == np.float32 else dict(rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(want), **tol)


@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
@pytest.mark.parametrize("length", [1, 64])
def test_fp8_pages_lower_for_cuda(implementation, length):
    # the flagship's full attention: 32 query / 2 KV heads of 256 (per device under TP8: 4 / 1), 4k context
    S = jax.ShapeDtypeStruct
    n, hq, hkv, d, bs = 8, 4, 1, 256, 16
    pages = S((hkv, 4096 // bs + 1, bs, d), F8)
    text = jax.jit(lambda q, kp, vp, bt, kv, pos: ops.paged_attention(
        q, kp, vp, bt, kv, pos, sm_scale=d ** -0.5, implementation=implementation)).trace(
        S((n, length, hq, d), jnp.bfloat16), pages, pages, S((n, 4096 // bs), jnp.int32), S((n,), jnp.int32),
        S((n, length), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert calls, "paged attention did not lower to the Pallas Triton custom call"
    assert any("xf8E4M3FN>" in line for line in calls), "the kernel must take the e4m3 pages as they are"
