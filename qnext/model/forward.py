"""The model step: forward(params, buffers, inputs, cfg) -> (logits, buffers). Pure; buffers are donated."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qnext.config import ModelConfig
from qnext.model.attention import full_attention
from cache.device_buffers import CacheBuffers
from qnext.model.deltanet import gated_deltanet
from qnext.ops.linear import linear
from qnext.ops.lora_weight import bind_lora_slots
from qnext.model.mlp import feed_forward
from qnext.model.norms import rms_norm
from qnext.model.snapshot_staging import capture_rows, restore_rows, stage
from qnext.model.step_inputs import StepInputs
from qnext.model.tensor_parallel import all_reduce, gather_vocab, mixer_all_reduce


def decoder_stack(params, buffers: CacheBuffers, inputs: StepInputs, cfg: ModelConfig, linear_layer=None):
    """The decoder layers over the flat batch: (x [T, H] before the final norm, updated buffers). KV layers of the
    buffers past the model's own (the MTP head's) pass through untouched. `linear_layer(p, h, conv, recurrent,
    inputs, cfg) -> (out, conv, recurrent)` replaces the Gated DeltaNet core (the verify step's per-position form,
    which captures nothing itself: qnext/model/verify.py's commit_positions writes its captures). With a narrow
    snapshot pool, snapshot reads and captures are staged through float32 rows (qnext/model/snapshot_staging.py)."""
    captures_here = linear_layer is None
    linear_layer = linear_layer or gated_deltanet
    inputs, moves = stage(buffers, inputs)
    if inputs.lora_slots is not None:              # LoRA: each token's projections add its adapter's delta
        params = bind_lora_slots(params, inputs.lora_slots)
    x = params["embed"][inputs.token_ids]
    if inputs.visual_embeds is not None:          # image / video pad tokens take the tower's output
        x = x.at[inputs.visual_token_index].set(inputs.visual_embeds.astype(x.dtype), mode="drop")
    kv, conv, recurrent = list(buffers.kv), list(buffers.conv), list(buffers.recurrent)
    pool_conv, pool_recurrent = list(buffers.snapshot_conv), list(buffers.snapshot_recurrent)
    kv_i = lin_i = 0
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
            if cfg.is_linear_layer(i):
                j = lin_i
                if moves is not None:
                    conv[j], recurrent[j], pool_conv[j], pool_recurrent[j] = restore_rows(
                        conv[j], recurrent[j], pool_conv[j], pool_recurrent[j], moves)
                out, conv[j], recurrent[j] = linear_layer(p["attn"], h, conv[j], recurrent[j], inputs, cfg)
                if moves is not None and captures_here:
                    conv[j], recurrent[j], pool_conv[j], pool_recurrent[j] = capture_rows(
                        conv[j], recurrent[j], pool_conv[j], pool_recurrent[j], moves)
                lin_i += 1
            else:
                out, kv[kv_i] = full_attention(p["attn"], h, kv[kv_i], inputs, cfg)
                kv_i += 1
            x = x + mixer_all_reduce(out, cfg)        # the sum of the devices' partial outputs (tensor parallel)
            mlp_out = feed_forward(p["mlp"], rms_norm(x, p["post_attn_norm"], cfg.rms_norm_eps), cfg, i)
            x = x + all_reduce(mlp_out, cfg)
    return x, buffers.replace(kv=tuple(kv), conv=tuple(conv), recurrent=tuple(recurrent),
                              snapshot_conv=tuple(pool_conv), snapshot_recurrent=tuple(pool_recurrent))


def lm_logits(params, h, cfg: ModelConfig):
    """Final-normed hidden states [M, H] -> logits [M, V] float32."""
    logits = linear(h, params["lm_head"], preferred_element_type=jnp.float32)
    return gather_vocab(logits, cfg)                  # tensor parallel: each device computed its part of the vocab


def forward(params, buffers: CacheBuffers, inputs: StepInputs, cfg: ModelConfig):
    """Returns (logits [M, V] float32 for inputs.logits_index, updated buffers)."""
    x, buffers = decoder_stack(params, buffers, inputs, cfg)
    h = rms_norm(x[inputs.logits_index], params["final_norm"], cfg.rms_norm_eps)
    return lm_logits(params, h, cfg), buffers


def forward_with_hidden(params, buffers: CacheBuffers, inputs: StepInputs, cfg: ModelConfig):
    """forward, plus the final-normed hidden state of every flat token [T, H] (what the MTP head drafts from)."""
    x, buffers = decoder_stack(params, buffers, inputs, cfg)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return lm_logits(params, hidden[inputs.logits_index], cfg), hidden, buffers


@functools.lru_cache(maxsize=None)
def make_step(cfg: ModelConfig):
    """The jitted step for one model config; cache buffers are donated (updated in place on device). One per
    config, so engines of the same model share compilations."""
    return jax.jit(functools.partial(forward, cfg=cfg), donate_argnums=(1,))
