"""The model step: forward(params, buffers, inputs, cfg) -> (logits, buffers). Pure; buffers are donated."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qnext.config import ModelConfig
from qnext.model.attention import full_attention
from cache.device_buffers import CacheBuffers
from qnext.model.deltanet import gated_deltanet
from qnext.model.linear import linear
from qnext.model.mlp import feed_forward
from qnext.model.norms import rms_norm
from qnext.model.step_inputs import StepInputs
from qnext.model.tensor_parallel import all_reduce, gather_vocab, mixer_all_reduce


def forward(params, buffers: CacheBuffers, inputs: StepInputs, cfg: ModelConfig):
    """Returns (logits [M, V] float32 for inputs.logits_index, updated buffers)."""
    x = params["embed"][inputs.token_ids]
    kv, conv, recurrent = list(buffers.kv), list(buffers.conv), list(buffers.recurrent)
    kv_i = lin_i = 0
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
            if cfg.is_linear_layer(i):
                out, conv[lin_i], recurrent[lin_i] = gated_deltanet(p["attn"], h, conv[lin_i], recurrent[lin_i],
                                                                    inputs, cfg)
                lin_i += 1
            else:
                out, kv[kv_i] = full_attention(p["attn"], h, kv[kv_i], inputs, cfg)
                kv_i += 1
            x = x + mixer_all_reduce(out, cfg)        # the sum of the devices' partial outputs (tensor parallel)
            mlp_out = feed_forward(p["mlp"], rms_norm(x, p["post_attn_norm"], cfg.rms_norm_eps), cfg, i)
            x = x + all_reduce(mlp_out, cfg)
    h = rms_norm(x[inputs.logits_index], params["final_norm"], cfg.rms_norm_eps)
    logits = linear(h, params["lm_head"], preferred_element_type=jnp.float32)
    logits = gather_vocab(logits, cfg)                # tensor parallel: each device computed its part of the vocab
    return logits, CacheBuffers(kv=tuple(kv), conv=tuple(conv), recurrent=tuple(recurrent))


@functools.lru_cache(maxsize=None)
def make_step(cfg: ModelConfig):
    """The jitted step for one model config; cache buffers are donated (updated in place on device). One per
    config, so engines of the same model share compilations."""
    return jax.jit(functools.partial(forward, cfg=cfg), donate_argnums=(1,))
