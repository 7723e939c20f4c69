"""The model over dense batches [B, T] with left padding, differentiable: the one dense forward (the Flax model's
forward, MTP training's and the reference speculative loop's target).

The per-layer math is the engine's own (qnext/model/attention.py, deltanet.py, mlp.py, norms.py): only the sequence
mixers' cores differ. Attention is dense causal softmax attention with padded keys masked, where the engine reads
paged KV; the DeltaNet runs the engine's conv op on a fresh zero state and the chunked delta rule of
qnext/model/dense_delta_rule.py, where the engine runs its state-row kernels. The Pallas kernels have no VJP, so
this path always uses the jnp forms, on GPU too.

Left padding (attention_mask 0) never reaches a real token: attention masks padded keys, and a padded token is
the DeltaNet's identity (its conv input is zeroed, beta = 0 and g = 0, so the state passes through unchanged).
Positions count real tokens only, so a padded row's logits at its real tokens equal the unpadded row's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as ops
from qnext.config import ModelConfig
from qnext.model.dense_delta_rule import dense_gated_delta_rule
from qnext.model.attention import attention_inputs, attention_output
from qnext.model.deltanet import delta_rule_inputs, deltanet_output, deltanet_projections
from qnext.ops.linear import linear
from qnext.model.mlp import feed_forward
from qnext.model.norms import rms_norm

_HIGHEST = jax.lax.Precision.HIGHEST


def causal_attention(q, k, v, mask):
    """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; mask: [B, T] bool (False = padding key). Softmax in float32,
    scale D^-1/2, GQA (query head h uses kv head h // (Hq / Hkv)). Returns [B, T, Hq, D] float32.
    A query with no visible key (a padded query of a left-padded row) averages the padded keys: finite, unused."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d) * d ** -0.5
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k.astype(jnp.float32), precision=_HIGHEST)
    visible = jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]                  # [B, Tq, Tk]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(b, t, hq, d)


def dense_full_attention(p, x, positions, mask, cfg: ModelConfig):
    """x: [B, T, H]; positions: [B, T]; mask: [B, T] bool. Returns [B, T, H]."""
    q, gate, k, v = attention_inputs(p, x, positions, cfg)
    return attention_output(p, causal_attention(q, k, v, mask), gate, x.dtype)


def dense_gated_deltanet(p, x, mask, cfg: ModelConfig):
    """x: [B, T, H]; mask: [B, T] bool. Zero initial state. Returns [B, T, H]."""
    b, t = x.shape[:2]
    mixed, z, beta_logits, a = deltanet_projections(p, x, cfg)
    mixed = jnp.where(mask[..., None], mixed, 0)                  # the conv never sees a padded token's input
    zero_state = jnp.zeros((1, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), x.dtype)
    rows, every = jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)
    mixed, _ = ops.causal_conv1d_chunked(mixed, p["conv_weight"], zero_state, jnp.full((b,), t, jnp.int32),
                                         rows - 1, rows, rows, every, every, implementation="reference")
    q, k, v, g, beta = delta_rule_inputs(mixed, beta_logits, a, p, cfg)
    g = jnp.where(mask[..., None], g, 0.0)                        # padded token: no decay, no update
    beta = jnp.where(mask[..., None], beta, 0.0)
    return deltanet_output(p, dense_gated_delta_rule(q, k, v, g, beta), z, x.dtype, cfg)


def dense_decoder_layer(p, x, positions, mask, cfg: ModelConfig, layer: int):
    """One pre-norm decoder layer over x [B, T, H]."""
    h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    if cfg.is_linear_layer(layer):
        x = x + dense_gated_deltanet(p["attn"], h, mask, cfg)
    else:
        x = x + dense_full_attention(p["attn"], h, positions, mask, cfg)
    return x + feed_forward(p["mlp"], rms_norm(x, p["post_attn_norm"], cfg.rms_norm_eps), cfg, layer)


def dense_hidden(params, input_ids, attention_mask, cfg: ModelConfig, visual_embeds=None, visual_mask=None,
                 rope_positions=None):
    """params: the engine's weights pytree (docs/CONTRACTS.md); input_ids: [B, T] int; attention_mask: [B, T] of
    1 (token) / 0 (left padding), or None. Images and video (qnext/vision): visual_embeds [N, H], the tower's
    output, replaces the embeddings where visual_mask [B, T] is True, in row-major order; rope_positions [3, B, T]
    the MRoPE positions (qnext/vision/mrope.batch_mrope_positions). Returns (final-normed hidden states
    [B, T, H], logits [B, T, V] float32)."""
    if cfg.tensor_parallel_size != 1:
        raise ValueError(f"the dense forward runs one device's whole model; got a tensor-parallel shard config "
                         f"(tensor_parallel_size={cfg.tensor_parallel_size})")
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {input_ids.shape}")
    if attention_mask is None:
        mask = jnp.ones(input_ids.shape, bool)
    else:
        mask = jnp.asarray(attention_mask).astype(bool)
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {mask.shape}; input_ids has {input_ids.shape}")
    positions = jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)   # real tokens count from 0
    if rope_positions is not None:
        positions = jnp.asarray(rope_positions)
        if positions.shape != (3,) + input_ids.shape:
            raise ValueError(f"rope_positions has shape {positions.shape}; expected {(3,) + input_ids.shape}")
    x = params["embed"][input_ids]
    if visual_embeds is not None:
        x = place_visual_embeds(x, visual_embeds, visual_mask)
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            x = dense_decoder_layer(p, x, positions, mask, cfg, i)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return h, linear(h, params["lm_head"], preferred_element_type=jnp.float32)


def dense_forward(params, input_ids, attention_mask, cfg: ModelConfig, **visual):
    """Logits [B, T, V] float32 of dense_hidden (visual: its visual_embeds, visual_mask, rope_positions)."""
    return dense_hidden(params, input_ids, attention_mask, cfg, **visual)[1]


def place_visual_embeds(x, visual_embeds, visual_mask):
    """x: [B, T, H]; visual_embeds: [N, H]; visual_mask: [B, T] bool with N True entries. Row-major masked scatter
    (the i-th True position takes row i), differentiable in both x and visual_embeds."""
    flat_mask = jnp.asarray(visual_mask).reshape(-1)
    order = jnp.clip(jnp.cumsum(flat_mask, dtype=jnp.int32) - 1, 0, visual_embeds.shape[0] - 1)
    flat = jnp.where(flat_mask[:, None], visual_embeds.astype(x.dtype)[order], x.reshape(-1, x.shape[-1]))
    return flat.reshape(x.shape)
