"""The GPU path's fp8 matmul (qnext/model/fp8_linear.py): equal to the GEMM of the dequantised weights on CPU, and
lowered for CUDA at the 27B / 80B / 397B shapes with the weights as e4m3 parameters (on a CPU-only host: lowering
checks the StableHLO, not ptxas or the speed; scripts/gpu_check.py times both formulations)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.model.fp8_blocks import dequantize, quantize
from qnext.model.fp8_linear import dequantize_on_device, fp8_linear, lower_for_cuda
from qnext.ops.linear import linear
from qnext.model.mlp import grouped_matmul

S = jax.ShapeDtypeStruct
F8, BF16, F32, I32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.int32
BLOCK = (128, 128)

# (out, in) of the largest dense projections: Qwen3.5-27B's MLP, Qwen3-Next-80B's q_proj and shared expert,
# Qwen3.5-397B's q_proj and shared expert
DENSE = {"27B gate_up": (34816, 5120), "27B down": (5120, 17408), "80B q_proj": (8192, 2048),
         "80B shared down": (2048, 512), "397B q_proj": (16384, 4096), "397B shared gate_up": (8192, 4096)}
# experts [E, out, in] as stored: 80B 512 x 512 wide, 397B 512 x 1024 wide (gate_up)
EXPERTS = {"80B": (512, 1024, 2048), "397B": (512, 2048, 4096)}


def _case(rows, out, k, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, k)) * np.linspace(0.02, 0.2, k)).astype(np.float32)
    q, s = quantize(w, BLOCK)
    return rng.standard_normal((rows, k)).astype(np.float32), q, s


@pytest.mark.parametrize("rows, out, k", [(3, 200, 300), (40, 256, 384)])
def test_dequantize_formulation_equals_gemm_of_dequantised_weights(rows, out, k):
    x, q, s = _case(rows, out, k)
    got = jax.jit(fp8_linear, static_argnums=(3, 4))(x, q, s, BLOCK, "dequantize")
    np.testing.assert_array_equal(np.asarray(dequantize_on_device(q, s, BLOCK, F32)), dequantize(q, s, BLOCK))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(linear)(x, dequantize(q, s, BLOCK))))


@pytest.mark.parametrize("rows, out, k", [(3, 200, 300), (40, 256, 384)])
def test_scaled_dot_formulation_is_within_activation_rounding(rows, out, k):
    x, q, s = _case(rows, out, k)
    got = np.asarray(jax.jit(fp8_linear, static_argnums=(3, 4))(x, q, s, BLOCK, "scaled_dot"))
    want = x @ dequantize(q, s, BLOCK).T
    # each activation rounds to e4m3 (relative error <= 1/16, ~3% typical); errors average out over k products
    scale = np.abs(x) @ np.abs(dequantize(q, s, BLOCK)).T
    assert np.all(np.abs(got - want) <= scale / 16)
    assert np.abs(got - want).mean() > 0  # the activations were quantised (this is not the dequantize path)


def _f8_params(text):
    main = re.search(r"func.func public @main\((.*)", text).group(1)  # the program's parameters
    return len(re.findall(r"tensor<[0-9x]*xf8E4M3FN>", main.split("->")[0]))


@pytest.mark.parametrize("name", sorted(DENSE))
@pytest.mark.parametrize("rows", [8, 2048])
def test_dense_fp8_linear_lowers_for_cuda_with_fp8_weights(name, rows):
    out, k = DENSE[name]
    specs = (S((rows, k), BF16), S((out, k), F8), S((-(-out // 128), -(-k // 128)), F32))
    dequant = lower_for_cuda(lambda x, q, s: fp8_linear(x, q, s, BLOCK, "dequantize"), *specs)
    scaled = lower_for_cuda(lambda x, q, s: fp8_linear(x, q, s, BLOCK, "scaled_dot"), *specs)
    for text in (dequant, scaled):
        assert _f8_params(text) == 1, "the weight must enter the program as e4m3"
    # dequantize: the widened weight feeds a bf16 GEMM; scaled_dot: an fp8 x fp8 -> float32 dot per K block
    assert re.search(r"dot_general .*\(tensor<[0-9x]+xbf16>, tensor<[0-9x]+xbf16>\) -> tensor<[0-9x]+xbf16>", dequant)
    assert re.search(r"dot_general .*\(tensor<\d+x128xf8E4M3FN>, tensor<\d+x128xf8E4M3FN>\) -> tensor<\d+x\d+xf32>",
                     scaled)


@pytest.mark.parametrize("name", sorted(EXPERTS))
def test_expert_stack_dequantised_inside_the_grouped_matmul_lowers_for_cuda(name):
    e, out, k = EXPERTS[name]
    rows = 256

    def experts(x, q, s, group_sizes):  # HF [E, out, in] -> the grouped matmul's [E, in, out]
        w = dequantize_on_device(q, s, BLOCK, x.dtype).swapaxes(1, 2)
        return grouped_matmul(x, w, group_sizes, ragged=True)

    text = lower_for_cuda(experts, S((rows, k), BF16), S((e, out, k), F8), S((e, out // 128, k // 128), F32),
                          S((e,), I32))
    assert _f8_params(text) == 1
    assert "ragged_dot" in text or "dot_general" in text
