"""Gated full attention over paged KV: q/k RMSNorm, partial RoPE, GQA, sigmoid output gate."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as ops
from qnext.config import ModelConfig
from qnext.model.groups import from_groups, query_positions, to_decode, to_prefill
from qnext.model.linear import linear
from qnext.model.norms import rms_norm
from qnext.model.rotary import apply_rotary
from qnext.model.step_inputs import StepInputs


def full_attention(p, x, kv, inputs: StepInputs, cfg: ModelConfig):
    """x: [T, H]; kv: (k_pages, v_pages). Returns (out [T, H], kv)."""
    t = x.shape[0]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    proj = linear(x, p["qkv_proj"])
    if "qkv_bias" in p:
        proj = proj + p["qkv_bias"]
    q, gate, k, v = jnp.split(proj, [hq * d, 2 * hq * d, 2 * hq * d + hkv * d], axis=-1)
    q = rms_norm(q.reshape(t, hq, d), p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k.reshape(t, hkv, d), p["k_norm"], cfg.rms_norm_eps)
    q = apply_rotary(q, inputs.positions, cfg)
    k = apply_rotary(k, inputs.positions, cfg)
    k_pages, v_pages = ops.write_kv(*kv, k, v.reshape(t, hkv, d), inputs.slot_mapping)

    def attend(q_groups, groups):
        if groups.length.shape[0] == 0:            # static: the bucket has no groups of this kind
            return jnp.zeros(q_groups.shape, jnp.float32)
        return ops.paged_attention(q_groups, k_pages, v_pages, groups.block_table, groups.kv_len,
                                   query_positions(groups, inputs.positions), sm_scale=d ** -0.5)

    out_decode = attend(to_decode(q, inputs)[:, None], inputs.decode)[:, 0]
    out_prefill = attend(to_prefill(q, inputs), inputs.prefill)
    out = from_groups(out_decode, out_prefill, inputs).astype(x.dtype).reshape(t, hq * d)
    out = out * jax.nn.sigmoid(gate)
    out = linear(out, p["o_proj"])
    if "o_bias" in p:
        out = out + p["o_bias"]
    return out, (k_pages, v_pages)
