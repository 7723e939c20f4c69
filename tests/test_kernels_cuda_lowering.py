"""Every Pallas kernel lowers for CUDA through the Triton backend at the real model shapes, on a CPU-only host.

Lowering runs the whole Pallas -> Triton IR path (power-of-two rule, supported primitives, no scalar prefetch);
it does not run ptxas, so register pressure and numerics still need a GPU (scripts/bench_kernels.py --gpu).
The ops go through the public dispatch with implementation="pallas".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as ops

S = jax.ShapeDtypeStruct
I32, BF16, F32 = jnp.int32, jnp.bfloat16, jnp.float32
TRITON_CALL = "__gpu$xla.gpu.triton"

N, C = 8, 64                            # groups per call, prefill group length
HQ, HKV, D = 16, 2, 256                  # full attention
HK, HV, DK, DV = 16, 32, 128, 128        # linear attention
CONV_DIM, WIDTH = 2 * HK * DK + HV * DV, 4
R = 9                                    # state rows


def _lower_for_cuda(fn, *specs):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _assert_triton(text):
    assert TRITON_CALL in text, "kernel did not lower to the Pallas Triton custom call"
    assert "mosaic_gpu" not in text


@pytest.mark.parametrize("length", [1, C])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("q_dtype", [BF16, F32])
def test_paged_attention_lowers_to_triton(length, block_size, q_dtype):
    pages = S((HKV, 4096 // block_size + 1, block_size, D), BF16)
    text = _lower_for_cuda(
        lambda q, kp, vp, bt, kv, pos: ops.paged_attention(q, kp, vp, bt, kv, pos, sm_scale=D ** -0.5,
                                                           implementation="pallas"),
        S((N, length, HQ, D), q_dtype), pages, pages, S((N, 4096 // block_size), I32), S((N,), I32),
        S((N, length), I32))
    _assert_triton(text)


# (q/k dtype, v dtype): the model feeds float32 L2-normalised q/k with v in the model dtype.
GDR_DTYPES = [(BF16, BF16), (F32, F32), (F32, BF16)]


@pytest.mark.parametrize("qk_dtype, v_dtype", GDR_DTYPES)
def test_chunk_gated_delta_rule_lowers_to_triton(qk_dtype, v_dtype):
    rows, flags = S((N,), I32), S((N,), jnp.bool_)
    text = _lower_for_cuda(
        lambda *a: ops.chunk_gated_delta_rule(*a, implementation="pallas"),
        S((N, C, HK, DK), qk_dtype), S((N, C, HK, DK), qk_dtype), S((N, C, HV, DV), v_dtype), S((N, C, HV), F32),
        S((N, C, HV), F32), rows, S((R, HV, DK, DV), F32), rows, rows, rows, flags, flags)
    _assert_triton(text)


@pytest.mark.parametrize("qk_dtype, v_dtype", GDR_DTYPES)
def test_recurrent_gated_delta_rule_lowers_to_triton(qk_dtype, v_dtype):
    rows = S((N,), I32)
    text = _lower_for_cuda(
        lambda *a: ops.recurrent_gated_delta_rule(*a, implementation="pallas"),
        S((N, HK, DK), qk_dtype), S((N, HK, DK), qk_dtype), S((N, HV, DV), v_dtype), S((N, HV), F32), S((N, HV), F32),
        S((R, HV, DK, DV), F32), rows, rows, rows)
    _assert_triton(text)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_causal_conv1d_chunked_lowers_to_triton(dtype):
    rows, flags = S((N,), I32), S((N,), jnp.bool_)
    text = _lower_for_cuda(
        lambda *a: ops.causal_conv1d_chunked(*a, implementation="pallas"),
        S((N, C, CONV_DIM), dtype), S((CONV_DIM, WIDTH), dtype), S((R, WIDTH - 1, CONV_DIM), dtype),
        rows, rows, rows, rows, flags, flags)
    _assert_triton(text)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_causal_conv1d_update_lowers_to_triton(dtype):
    rows = S((N,), I32)
    text = _lower_for_cuda(
        lambda *a: ops.causal_conv1d_update(*a, implementation="pallas"),
        S((N, CONV_DIM), dtype), S((CONV_DIM, WIDTH), dtype), S((R, WIDTH - 1, CONV_DIM), dtype), rows, rows, rows)
    _assert_triton(text)
