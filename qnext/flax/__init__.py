"""Flax NNX front end: the engine's model as a trainable, differentiable module.

    model = qnext.flax.from_pretrained(path)            # a HybridCausalLM (nnx.Module), engine layout params
    logits = model(input_ids, attention_mask)            # [B, T] int32 (left padding) -> [B, T, V] float32
    config, params = qnext.flax.engine_params(model)     # the engine's weights pytree, a view of the module
    qnext.flax.save_pretrained(model, out_dir)           # Hugging Face checkpoint in the source's layout
    logp = qnext.flax.token_logprobs(model, ids, mask)   # each next token's log-prob [B, T-1] (a trainer's score)
    logits = model(input_ids, attention_mask, **qnext.flax.image_batch(model, input_ids, attention_mask, visuals))
                                                         # images / video (a VL checkpoint's tower, qnext/vision)

The forward runs the engine's layer code with dense cores for the sequence mixers (qnext/model/dense.py):
causal attention with a padding mask and the jnp chunked gated delta rule, on every backend, because the engine's
Pallas kernels have no VJP.
"""
from qnext.model.dense import dense_forward
from qnext.flax.model import (
    DecoderLayer,
    HybridCausalLM,
    ParamGroup,
    SourceCheckpoint,
    as_engine_params,
    engine_params,
    from_pretrained,
    vision_params,
)
from qnext.flax.vision import VisionTower, image_batch
from qnext.flax.save import save_pretrained
from qnext.flax.scoring import token_logprobs

__all__ = ["DecoderLayer", "HybridCausalLM", "ParamGroup", "SourceCheckpoint", "as_engine_params", "dense_forward",
           "engine_params", "from_pretrained", "image_batch", "save_pretrained",
           "token_logprobs", "vision_params", "VisionTower"]
