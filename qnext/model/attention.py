"""Gated full attention: q/k RMSNorm, partial RoPE, GQA, sigmoid output gate.

`attention_inputs` and `attention_output` are the layer's math around its core, shared by the engine's paged step
(`full_attention` below) and the dense [B, T] path of qnext/flax (causal attention with a padding mask).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as ops
from qnext.config import ModelConfig
from qnext.model.fp8_blocks import E4M3_MAX
from qnext.model.groups import from_groups, query_positions, to_decode, to_prefill
from qnext.ops.linear import linear
from qnext.model.norms import rms_norm
from qnext.model.prefill_attention import MIN_GROUPS, prefill_attention_by_sequence
from qnext.model.rotary import apply_rotary
from qnext.model.step_inputs import StepInputs


def attention_inputs(p, x, positions, cfg: ModelConfig):
    """x: [..., T, H]; positions: [..., T]. Returns q [..., T, Hq, D] (normed, rotated), gate [..., T, Hq*D],
    k [..., T, Hkv, D] (normed, rotated), v [..., T, Hkv, D]."""
    lead = x.shape[:-1]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    proj = linear(x, p["qkv_proj"])
    if "qkv_bias" in p:
        proj = proj + p["qkv_bias"]
    q, gate, k, v = jnp.split(proj, [hq * d, 2 * hq * d, 2 * hq * d + hkv * d], axis=-1)
    q = rms_norm(q.reshape(lead + (hq, d)), p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k.reshape(lead + (hkv, d)), p["k_norm"], cfg.rms_norm_eps)
    q = apply_rotary(q, positions, cfg)
    k = apply_rotary(k, positions, cfg)
    return q, gate, k, v.reshape(lead + (hkv, d))


def attention_output(p, attended, gate, dtype):
    """attended: [..., T, Hq, D] (float32 from the core); gate: [..., T, Hq*D]. Returns [..., T, H] in dtype."""
    out = attended.astype(dtype).reshape(gate.shape)
    out = out * jax.nn.sigmoid(gate)
    out = linear(out, p["o_proj"])
    if "o_bias" in p:
        out = out + p["o_bias"]
    return out


def full_attention(p, x, kv, inputs: StepInputs, cfg: ModelConfig, new_kv=None):
    """x: [T, H]; kv: (k_pages, v_pages). Returns (out [T, H], kv). new_kv(k, v, slot_mapping) -> the same three:
    the keys, values and slots written into the pages (context parallel: every shard's, context_parallel_step.py).

    fp8 pages (kv_cache_dtype fp8) hold k / s and v / s (s = cfg.kv_cache_scale), clipped to e4m3's range; the
    scale comes back as a factor of the softmax scale (scores q.k) and of the output (p.v), both in float32."""
    rope_positions = inputs.positions if inputs.rope_positions is None else inputs.rope_positions
    q, gate, k, v = attention_inputs(p, x, rope_positions, cfg)
    fp8 = kv[0].dtype == jnp.float8_e4m3fn
    scale = cfg.kv_cache_scale if fp8 else 1.0
    if fp8:
        k, v = (jnp.clip(t.astype(jnp.float32) / scale, -E4M3_MAX, E4M3_MAX) for t in (k, v))
    slots = inputs.slot_mapping
    if new_kv is not None:
        k, v, slots = new_kv(k, v, slots)
    k_pages, v_pages = ops.write_kv(*kv, k, v, slots, implementation=cfg.kernels)

    def attend(q_groups, groups):
        if groups.length.shape[0] == 0:            # static: the bucket has no groups of this kind
            return jnp.zeros(q_groups.shape, jnp.float32)
        return ops.paged_attention(q_groups, k_pages, v_pages, groups.block_table, groups.kv_len,
                                   query_positions(groups, inputs.positions), sm_scale=cfg.head_dim ** -0.5 * scale,
                                   implementation=cfg.kernels) * scale

    def attend_prefill(q_groups, groups):
        if cfg.kernels != "reference" or groups.length.shape[0] < MIN_GROUPS:
            return attend(q_groups, groups)
        # the jnp path: a long prefill's context read once a step, not once per group (prefill_attention.py)
        return prefill_attention_by_sequence(
            q_groups, k_pages, v_pages, groups.block_table, groups.kv_len, query_positions(groups, inputs.positions),
            groups.is_first, groups.length, sm_scale=cfg.head_dim ** -0.5 * scale) * scale

    out_decode = attend(to_decode(q, inputs)[:, None], inputs.decode)[:, 0]
    out_prefill = attend_prefill(to_prefill(q, inputs), inputs.prefill)
    out = attention_output(p, from_groups(out_decode, out_prefill, inputs), gate, x.dtype)
    return out, (k_pages, v_pages)
