"""Gated DeltaNet (linear attention) over per-sequence state rows.

Order (as the reference): fused projection -> causal conv1d + SiLU over [q | k | v] -> split -> L2-normalise q, k
(eps 1e-6 added to the sum of squares) -> q * dk^-1/2 -> beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
-> gated delta rule (state float32) -> gated RMSNorm with z -> out_proj.

`deltanet_projections`, `delta_rule_inputs` and `deltanet_output` are the layer's math around its two cores (the
conv and the delta rule), shared by the engine's step over state rows (`gated_deltanet` below) and the dense
[B, T] path of qnext/flax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as ops
from qnext.config import ModelConfig
from qnext.model.groups import from_groups, to_decode, to_prefill
from qnext.ops.linear import linear
from qnext.model.norms import gated_rms_norm
from qnext.model.step_inputs import StepInputs


def _l2_normalize(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def deltanet_projections(p, x, cfg: ModelConfig):
    """x: [..., H] -> mixed [..., conv_dim] (the conv's input, channels q | k | v), z [..., Hv*dv], b, a [..., Hv]."""
    hv = cfg.linear_num_value_heads
    proj = linear(x, p["in_proj"])
    return jnp.split(proj, [cfg.conv_dim, cfg.conv_dim + cfg.value_dim, cfg.conv_dim + cfg.value_dim + hv], axis=-1)


def delta_rule_inputs(mixed, b, a, p, cfg: ModelConfig):
    """Conv outputs [..., conv_dim] and b, a [..., Hv] -> q, k [..., Hk, dk], v [..., Hv, dv], g, beta (f32)."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    lead = mixed.shape[:-1]
    q, k, v = jnp.split(mixed, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    q = _l2_normalize(q.reshape(lead + (hk, dk))) * dk ** -0.5
    k = _l2_normalize(k.reshape(lead + (hk, dk)))
    v = v.reshape(lead + (hv, dv))
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["A_log"]) * jax.nn.softplus(a.astype(jnp.float32) + p["dt_bias"])
    return q, k, v, g, beta


def deltanet_output(p, o, z, dtype, cfg: ModelConfig):
    """o: [..., Hv, dv] (float32 from the delta rule); z: [..., Hv*dv]. Gated RMSNorm, out_proj -> [..., H]."""
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    lead = o.shape[:-2]
    out = gated_rms_norm(o.astype(dtype), z.reshape(lead + (hv, dv)), p["norm"], cfg.rms_norm_eps)
    return linear(out.reshape(lead + (hv * dv,)), p["out_proj"])


def gated_deltanet(p, x, conv_state, recurrent_state, inputs: StepInputs, cfg: ModelConfig):
    """x: [T, H]. Returns (out [T, H], conv_state, recurrent_state)."""
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    mixed, z, b, a = deltanet_projections(p, x, cfg)
    dec, pre, kernels = inputs.decode, inputs.prefill, cfg.kernels
    out_d = jnp.zeros((0, hv, dv), jnp.float32)
    out_p = jnp.zeros((0,) + pre.token_index.shape[1:] + (hv, dv), jnp.float32)
    if dec.length.shape[0]:                        # static: the bucket has decode rows
        mixed_d, conv_state = ops.causal_conv1d_update(to_decode(mixed, inputs), p["conv_weight"], conv_state,
                                                       dec.read_row, dec.write_row, dec.capture_row,
                                                       implementation=kernels)
        q, k, v, g, beta = delta_rule_inputs(mixed_d, to_decode(b, inputs), to_decode(a, inputs), p, cfg)
        out_d, recurrent_state = ops.recurrent_gated_delta_rule(q, k, v, g, beta, recurrent_state, dec.read_row,
                                                                dec.write_row, dec.capture_row, implementation=kernels)
    if pre.length.shape[0]:                        # static: the bucket has prefill groups
        mixed_p, conv_state = ops.causal_conv1d_chunked(to_prefill(mixed, inputs), p["conv_weight"], conv_state,
                                                        pre.length, pre.read_row, pre.write_row, pre.capture_row,
                                                        pre.is_first, pre.is_last, implementation=kernels)
        q, k, v, g, beta = delta_rule_inputs(mixed_p, to_prefill(b, inputs), to_prefill(a, inputs), p, cfg)
        out_p, recurrent_state = ops.chunk_gated_delta_rule(q, k, v, g, beta, pre.length, recurrent_state,
                                                            pre.read_row, pre.write_row, pre.capture_row,
                                                            pre.is_first, pre.is_last, implementation=kernels)

    out = deltanet_output(p, from_groups(out_d, out_p, inputs), z, x.dtype, cfg)      # [T, H]
    return out, conv_state, recurrent_state
