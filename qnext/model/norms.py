"""RMSNorms of Qwen3-Next / Qwen3.5. Statistics in float32, result cast back to the input dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _normalize(x, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm(x, weight, eps):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w). The checkpoint stores w (initialised to 0)."""
    return (_normalize(x, eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x, gate, weight, eps):
    """Output norm of Gated DeltaNet: w * (x / rms(x)) * silu(gate); plain w (initialised to 1), not 1 + w.
    Dtype path as the reference: normalise in f32, cast, scale by w, multiply by silu(gate) in f32, cast."""
    y = weight * _normalize(x, eps).astype(x.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
