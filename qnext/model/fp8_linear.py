"""x @ W^T with W kept as e4m3 block-quantised values in device memory (fp8_blocks.py: W = Q * S per block):
the GPU path, where the weights' bytes in HBM are the fp8 bytes. Two formulations, both jittable:

- "dequantize": inside the jitted matmul, Q is widened to x's dtype and multiplied by its block scales, then one
  ordinary GEMM (linear.py). The result equals the GEMM of the dequantised weights exactly (same products, same
  dot); on GPU XLA can fuse the widening into the GEMM's operand load, so W is read from HBM as fp8.
- "scaled_dot": XLA's fp8 dot. The activations are quantised on the fly to e4m3 per row and 128-column group
  (the release's `activation_scheme: dynamic`), each K block is one fp8 x fp8 -> float32 dot, scaled by the
  activation group's and the weight block's scales and accumulated in float32 (a loop over K blocks keeps the
  intermediate at [rows, out]). Activation quantisation adds a relative error of ~2^-4 per element.

Which one wins on a GPU is measured by scripts/gpu_check.py; both lower for CUDA at the 27B / 80B / 397B shapes
(tests/model/test_fp8_linear.py). The engine's CPU path dequantises at load instead (loader.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from qnext.model.fp8_blocks import E4M3_MAX
from qnext.ops.fp8_weight import dequantize_on_device
from qnext.ops.linear import linear

FORMULATIONS = ("dequantize", "scaled_dot")


def fp8_linear(x, q, scale_inv, block_size: tuple[int, int], formulation: str = "dequantize"):
    """x [..., in] with q [out, in] (e4m3) and scale_inv [ceil(out/b0), ceil(in/b1)] -> [..., out] in x.dtype."""
    if formulation == "dequantize":
        return linear(x, dequantize_on_device(q, scale_inv, block_size, x.dtype))
    if formulation == "scaled_dot":
        return _scaled_dot(x, q, scale_inv, block_size)
    raise ValueError(f"fp8 matmul formulation {formulation!r} is not one of {FORMULATIONS}")


def _scaled_dot(x, q, scale_inv, block_size):
    lead, k = x.shape[:-1], x.shape[-1]
    out = q.shape[0]
    b0, b1 = block_size
    kb = -(-k // b1)
    rows = x.reshape(-1, k).astype(jnp.float32)
    pad = kb * b1 - k
    if pad:  # zero columns add nothing to any dot
        rows, q = jnp.pad(rows, ((0, 0), (0, pad))), jnp.pad(q, ((0, 0), (0, pad)))
    groups = rows.reshape(rows.shape[0], kb, b1)                                  # [M, Kb, b1]
    x_scale = jnp.maximum(jnp.abs(groups).max(-1), 1e-12) / E4M3_MAX            # [M, Kb]
    xq = (groups / x_scale[..., None]).astype(jnp.float8_e4m3fn)
    wq = q.reshape(out, kb, b1)                                                  # [N, Kb, b1]
    w_scale = jnp.repeat(scale_inv.astype(jnp.float32), b0, axis=0)[:out]        # [N, Kb]

    def k_block(j, acc):
        xs = lax.dynamic_index_in_dim(xq, j, axis=1, keepdims=False)             # [M, b1] e4m3
        ws = lax.dynamic_index_in_dim(wq, j, axis=1, keepdims=False)             # [N, b1] e4m3
        part = lax.dot_general(xs, ws, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        xsc = lax.dynamic_index_in_dim(x_scale, j, axis=1)                       # [M, 1]
        wsc = lax.dynamic_index_in_dim(w_scale, j, axis=1)                       # [N, 1]
        return acc + part * xsc * wsc.T

    acc = lax.fori_loop(0, kb, k_block, jnp.zeros((rows.shape[0], out), jnp.float32))
    return acc.astype(x.dtype).reshape(*lead, out)


def lower_for_cuda(fn, *specs) -> str:
    """StableHLO text of `fn` lowered for CUDA (works on a CPU-only host: no ptxas, no GPU)."""
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
