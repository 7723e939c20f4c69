"""Every Pallas kernel lowers for CUDA at the real model shapes, on a CPU-only host, in both backends: Triton
(implementation="triton") and Mosaic GPU (implementation="mosaic", Hopper).

Lowering runs the whole Pallas -> Triton IR path (power-of-two rule, supported primitives, no scalar prefetch) or
the Pallas -> Mosaic GPU MLIR path (register layouts, TMA box limits, wgmma operand layouts, SMEM swizzles); it
does not run ptxas, so register pressure, SMEM capacity and numerics still need a GPU (scripts/gpu_check.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as ops

S = jax.ShapeDtypeStruct
I32, BF16, F32 = jnp.int32, jnp.bfloat16, jnp.float32
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "mosaic_gpu_v2"

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


def _assert_mosaic(text):
    assert MOSAIC_CALL in text, "kernel did not lower to the Mosaic GPU custom call"
    assert TRITON_CALL not in text


@pytest.mark.parametrize("length", [1, C])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("q_dtype", [BF16, F32])
def test_paged_attention_lowers_to_triton(length, block_size, q_dtype):
    pages = S((HKV, 4096 // block_size + 1, block_size, D), BF16)
    text = _lower_for_cuda(
        lambda q, kp, vp, bt, kv, pos: ops.paged_attention(q, kp, vp, bt, kv, pos, sm_scale=D ** -0.5,
                                                           implementation="triton"),
        S((N, length, HQ, D), q_dtype), pages, pages, S((N, 4096 // block_size), I32), S((N,), I32),
        S((N, length), I32))
    _assert_triton(text)


# (q/k dtype, v dtype): the model feeds float32 L2-normalised q/k with v in the model dtype.
GDR_DTYPES = [(BF16, BF16), (F32, F32), (F32, BF16)]


@pytest.mark.parametrize("qk_dtype, v_dtype", GDR_DTYPES)
def test_chunk_gated_delta_rule_lowers_to_triton(qk_dtype, v_dtype):
    rows, flags = S((N,), I32), S((N,), jnp.bool_)
    text = _lower_for_cuda(
        lambda *a: ops.chunk_gated_delta_rule(*a, implementation="triton"),
        S((N, C, HK, DK), qk_dtype), S((N, C, HK, DK), qk_dtype), S((N, C, HV, DV), v_dtype), S((N, C, HV), F32),
        S((N, C, HV), F32), rows, S((R, HV, DK, DV), F32), rows, rows, rows, flags, flags)
    _assert_triton(text)


@pytest.mark.parametrize("qk_dtype, v_dtype", GDR_DTYPES)
def test_recurrent_gated_delta_rule_lowers_to_triton(qk_dtype, v_dtype):
    rows = S((N,), I32)
    text = _lower_for_cuda(
        lambda *a: ops.recurrent_gated_delta_rule(*a, implementation="triton"),
        S((N, HK, DK), qk_dtype), S((N, HK, DK), qk_dtype), S((N, HV, DV), v_dtype), S((N, HV), F32), S((N, HV), F32),
        S((R, HV, DK, DV), F32), rows, rows, rows)
    _assert_triton(text)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_causal_conv1d_chunked_lowers_to_triton(dtype):
    rows, flags = S((N,), I32), S((N,), jnp.bool_)
    text = _lower_for_cuda(
        lambda *a: ops.causal_conv1d_chunked(*a, implementation="triton"),
        S((N, C, CONV_DIM), dtype), S((CONV_DIM, WIDTH), dtype), S((R, WIDTH - 1, CONV_DIM), dtype),
        rows, rows, rows, rows, flags, flags)
    _assert_triton(text)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_causal_conv1d_update_lowers_to_triton(dtype):
    rows = S((N,), I32)
    text = _lower_for_cuda(
        lambda *a: ops.causal_conv1d_update(*a, implementation="triton"),
        S((N, CONV_DIM), dtype), S((CONV_DIM, WIDTH), dtype), S((R, WIDTH - 1, CONV_DIM), dtype), rows, rows, rows)
    _assert_triton(text)


# ------------------------------------------------------------------------------------------------ Mosaic GPU
# Layer shapes of the three model sizes (qwen-math.md): (Hq, Hkv) of full attention, (Hk, Hv) of the delta rule;
# D = 256, dk = dv = 128 in all. Pages are bfloat16 (the Mosaic kernel's page dtypes: bf16, f16).
MODELS = {"qwen3.5-27b": ((24, 4), (16, 48)), "qwen3-next-80b": ((16, 2), (16, 32)),
          "qwen3.5-397b": ((32, 2), (16, 64))}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("length, block_size", [(1, 16), (C, 16), (C, 64)])
def test_paged_attention_lowers_to_mosaic(model, length, block_size):
    hq, hkv = MODELS[model][0]
    pages = S((hkv, 4096 // block_size + 1, block_size, D), BF16)
    text = _lower_for_cuda(
        lambda q, kp, vp, bt, kv, pos: ops.paged_attention(q, kp, vp, bt, kv, pos, sm_scale=D ** -0.5,
                                                           implementation="mosaic"),
        S((N, length, hq, D), BF16), pages, pages, S((N, 4096 // block_size), I32), S((N,), I32), S((N, length), I32))
    _assert_mosaic(text)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("qk_dtype, v_dtype", GDR_DTYPES)
def test_gated_delta_rule_lowers_to_mosaic(model, qk_dtype, v_dtype):
    hk, hv = MODELS[model][1]
    rows, flags = S((N,), I32), S((N,), jnp.bool_)
    pool = S((R, hv, DK, DV), F32)
    chunk = _lower_for_cuda(
        lambda *a: ops.chunk_gated_delta_rule(*a, implementation="mosaic"),
        S((N, C, hk, DK), qk_dtype), S((N, C, hk, DK), qk_dtype), S((N, C, hv, DV), v_dtype), S((N, C, hv), F32),
        S((N, C, hv), F32), rows, pool, rows, rows, rows, flags, flags)
    _assert_mosaic(chunk)
    recurrent = _lower_for_cuda(
        lambda *a: ops.recurrent_gated_delta_rule(*a, implementation="mosaic"),
        S((N, hk, DK), qk_dtype), S((N, hk, DK), qk_dtype), S((N, hv, DV), v_dtype), S((N, hv), F32), S((N, hv), F32),
        pool, rows, rows, rows)
    _assert_mosaic(recurrent)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_causal_conv1d_update_lowers_to_mosaic(model, dtype):
    hk, hv = MODELS[model][1]
    conv_dim = 2 * hk * DK + hv * DV
    rows = S((N,), I32)
    text = _lower_for_cuda(
        lambda *a: ops.causal_conv1d_update(*a, implementation="mosaic"),
        S((N, conv_dim), dtype), S((conv_dim, WIDTH), dtype), S((R, WIDTH - 1, conv_dim), dtype), rows, rows, rows)
    _assert_mosaic(text)


def test_mosaic_kernels_are_hlo_exportable():
    """mosaic_gpu_v2 is on jax.export's allow-list: a Mosaic kernel serialises with no disabled safety check."""
    pytest.importorskip("flatbuffers")
    rows = S((N,), I32)
    exported = jax.export.export(
        jax.jit(lambda *a: ops.recurrent_gated_delta_rule(*a, implementation="mosaic")), platforms=["cuda"])(
        S((N, HK, DK), BF16), S((N, HK, DK), BF16), S((N, HV, DV), BF16), S((N, HV), F32), S((N, HV), F32),
        S((R, HV, DK, DV), F32), rows, rows, rows)
    assert len(exported.serialize()) > 0
