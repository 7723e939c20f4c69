"""Every Pallas kernel equals its reference in interpret mode on CPU, over random ragged batches.

The ops are called through the public dispatch (`pallas_kernels.*`): interpret=True runs the Pallas kernel,
implementation="reference" the pure-jnp reference. Dims are small powers of two to keep interpretation cheap.
Pool rows other than the dummy row 0 must match exactly where the reference leaves them untouched.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as ops
from tests.support.kernel_cases import (ATTN_CASES, attn_inputs, decode_row_layout, gdr_inputs,
                                       random_attn_layout, random_row_layout)


def _both(op, *args, **kwargs):
    """(kernel, reference) results of one public op as numpy pytrees."""
    got = op(*args, interpret=True, **kwargs)
    want = jax.jit(functools.partial(op, implementation="reference", **kwargs))(*args)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), (got, want))


def _assert_pools(got, want, **tol):
    np.testing.assert_allclose(got[1:], want[1:], **tol)


# ------------------------------------------------------------------------------------------------ gated delta rule
@pytest.mark.parametrize("seed, seg_lens, c, hk, hv, dk, dv, dtype", [
    (0, (37, 1, 20), 16, 2, 2, 16, 64, np.float32),          # mixed: a 1-token segment among prefills; 2 V-blocks
    (1, (16, 50), 16, 1, 4, 16, 16, np.float32),             # GQA 4, boundary and off-boundary lengths
    (2, (70, 64, 3), 64, 1, 2, 32, 32, np.float32),          # C = 64, multi-group segments
    (3, (24, 9), 16, 2, 4, 32, 16, jnp.bfloat16),            # bf16 q/k/v
])
def test_chunk_gated_delta_rule_kernel(seed, seg_lens, c, hk, hv, dk, dv, dtype):
    rng = np.random.default_rng(seed)
    layout = random_row_layout(rng, seg_lens, c, num_pad=2)
    q, k, v, g, beta, pool = gdr_inputs(rng, layout.num_tokens, hk, hv, dk, dv, layout.num_rows, dtype)
    groups = [jnp.asarray(layout.to_groups(x, rng)) for x in (q, k, v, g, beta)]
    length, read_row, write_row, capture_row, is_first, is_last = layout.rows()
    (o, new_pool), (o_ref, pool_ref) = _both(ops.chunk_gated_delta_rule, *groups, length, jnp.asarray(pool),
                                             read_row, write_row, capture_row, is_first, is_last)
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == np.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(o, o_ref, **tol)
    _assert_pools(new_pool, pool_ref, **tol)


@pytest.mark.parametrize("seed, hk, hv, dk, dv", [(0, 2, 2, 16, 32), (1, 2, 4, 32, 64), (2, 1, 4, 16, 16)])
def test_recurrent_gated_delta_rule_kernel(seed, hk, hv, dk, dv):
    rng = np.random.default_rng(seed)
    layout = decode_row_layout(rng, 5, num_pad=2)
    q, k, v, g, beta, pool = gdr_inputs(rng, 5, hk, hv, dk, dv, layout.num_rows)
    rows = [jnp.asarray(x[:, 0]) for x in (layout.to_groups(y, rng) for y in (q, k, v, g, beta))]
    _, read_row, write_row, capture_row, _, _ = layout.rows()
    (o, new_pool), (o_ref, pool_ref) = _both(ops.recurrent_gated_delta_rule, *rows, jnp.asarray(pool), read_row,
                                             write_row, capture_row)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    _assert_pools(new_pool, pool_ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------- conv1d
@pytest.mark.parametrize("seed, seg_lens, c, d, dtype", [
    (0, (37, 2, 1, 16), 16, 32, np.float32),                 # segments shorter than the kernel width
    (1, (70, 5), 64, 128, jnp.bfloat16),                     # 2 channel blocks, bf16 state
])
def test_causal_conv1d_chunked_kernel(seed, seg_lens, c, d, dtype):
    rng = np.random.default_rng(seed)
    layout = random_row_layout(rng, seg_lens, c, num_pad=2)
    x = jnp.asarray(layout.to_groups(rng.normal(size=(layout.num_tokens, d)).astype(np.float32), rng), dtype)
    weight = jnp.asarray(rng.normal(size=(d, 4)), dtype)
    pool = jnp.asarray(rng.normal(size=(layout.num_rows, 3, d)), dtype).at[0].set(0)   # row 0: zero state
    (y, new_pool), (y_ref, pool_ref) = _both(ops.causal_conv1d_chunked, x, weight, pool, *layout.rows())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(y, y_ref, **tol)
    _assert_pools(new_pool, pool_ref, rtol=0, atol=0)


def test_causal_conv1d_update_kernel():
    rng = np.random.default_rng(5)
    layout = decode_row_layout(rng, 6, num_pad=2)
    d = 64
    x = jnp.asarray(layout.to_groups(rng.normal(size=(6, d)).astype(np.float32), rng)[:, 0])
    weight = jnp.asarray(rng.normal(size=(d, 4)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(layout.num_rows, 3, d)), jnp.float32).at[0].set(0)
    _, read_row, write_row, capture_row, _, _ = layout.rows()
    (y, new_pool), (y_ref, pool_ref) = _both(ops.causal_conv1d_update, x, weight, pool, read_row, write_row,
                                             capture_row)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    _assert_pools(new_pool, pool_ref, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ paged attention
@pytest.mark.parametrize("case, hq, hkv, d, block_size, dtype", [
    ("decode", 2, 2, 32, 16, np.float32),
    ("decode", 4, 2, 32, 16, np.float32),
    ("decode", 8, 2, 64, 32, jnp.bfloat16),
    ("prefill", 4, 2, 32, 16, np.float32),
    ("mixed", 8, 2, 32, 16, np.float32),
    ("mixed", 6, 1, 64, 16, jnp.bfloat16),                   # 6 q-heads per kv head, padded to 8
])
def test_paged_attention_kernel(case, hq, hkv, d, block_size, dtype):
    seqs, group_len = ATTN_CASES[case]
    rng = np.random.default_rng(hq + d)
    layout = random_attn_layout(rng, seqs, group_len, block_size, num_pad=1)
    q, k_pages, v_pages = (jnp.asarray(x, dtype) for x in attn_inputs(rng, layout, hq, hkv, d, block_size))
    got, want = _both(ops.paged_attention, q, k_pages, v_pages, jnp.asarray(layout.block_table),
                      jnp.asarray(layout.kv_len), jnp.asarray(layout.q_pos), sm_scale=d ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got, want, **tol)


def test_kernels_reject_shapes_triton_cannot_tile():
    q = jnp.zeros((1, 1, 2, 48))
    pages = jnp.zeros((2, 2, 16, 48))
    table, lens = jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        ops.paged_attention(q, pages, pages, table, lens, lens[:, None], sm_scale=1.0, interpret=True)
    rows = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="dk and dv must be powers of two"):
        ops.recurrent_gated_delta_rule(jnp.zeros((1, 1, 24)), jnp.zeros((1, 1, 24)), jnp.zeros((1, 1, 16)),
                                       jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros((2, 1, 24, 16)),
                                       rows, rows, rows, interpret=True)
