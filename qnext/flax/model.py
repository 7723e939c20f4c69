"""Flax NNX modules holding the engine's weights: `HybridCausalLM(input_ids, attention_mask) -> logits`.

The parameters are nnx.Param leaves in the engine's layout (docs/CONTRACTS.md: fused in_proj / qkv_proj / gate_up,
[out, in] matrices, [E, in, out] expert stacks), named as the keys of `qnext.model.weights.param_specs(cfg)`, so the
engine's params pytree is a view of the module's state (`engine_params`), and the forward is
qnext/model/dense.py over that view: the engine's layer code, with dense cores for the sequence mixers.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from qnext.config import ModelConfig, read_json
from qnext.model.dense import dense_forward
from qnext.model.checkpoint import load_checkpoint


@dataclasses.dataclass(frozen=True)
class SourceCheckpoint:
    """Where the weights came from: the checkpoint's config.json (as text, so the module stays hashable) and its
    directory when there is one (for the tokenizer files and the tensors the engine skips, on save)."""

    hf_config_json: str
    directory: str | None = None

    @property
    def hf_config(self) -> dict[str, Any]:
        return json.loads(self.hf_config_json)


class ParamGroup(nnx.Module):
    """A flat dict of the engine's params (one mixer or MLP) as nnx.Param attributes of the same names."""

    def __init__(self, params: dict[str, Any]):
        for name, value in params.items():
            setattr(self, name, nnx.Param(jnp.asarray(value)))


class DecoderLayer(nnx.Module):
    def __init__(self, layer: dict[str, Any]):
        self.input_norm = nnx.Param(jnp.asarray(layer["input_norm"]))
        self.post_attn_norm = nnx.Param(jnp.asarray(layer["post_attn_norm"]))
        self.attn = ParamGroup(layer["attn"])     # gated DeltaNet or gated attention, by the config's layer type
        self.mlp = ParamGroup(layer["mlp"])       # dense SwiGLU or MoE


class HybridCausalLM(nnx.Module):
    """Qwen3-Next / Qwen3.5 (dense or MoE) causal LM. `model(input_ids [B, T], attention_mask [B, T] | None)`
    returns float32 logits [B, T, V]; jittable (nnx.jit, or nnx.split + jax.jit) and differentiable. Left padding
    only (mask 1 for tokens, 0 for padding before them). With tied embeddings there is no lm_head param."""

    def __init__(self, config: ModelConfig, params: dict[str, Any], source: SourceCheckpoint):
        if config.tensor_parallel_size != 1:
            raise ValueError("HybridCausalLM holds a whole model; got a tensor-parallel shard config")
        self.config = config
        self.source = source
        self.embed = nnx.Param(jnp.asarray(params["embed"]))
        self.final_norm = nnx.Param(jnp.asarray(params["final_norm"]))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.asarray(params["lm_head"]))
        self.layers = nnx.List([DecoderLayer(layer) for layer in params["layers"]])

    def __call__(self, input_ids, attention_mask=None):
        return dense_forward(engine_params(self)[1], input_ids, attention_mask, self.config)


def as_engine_params(state: nnx.State, config: ModelConfig) -> dict[str, Any]:
    """The Param state of a HybridCausalLM (its values, or gradients of the same structure) as the engine's params
    pytree: the same arrays, no copies; lm_head is embed when the embeddings are tied."""
    tree = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
    params = {"embed": tree["embed"], "final_norm": tree["final_norm"],
              "lm_head": tree["embed"] if config.tie_word_embeddings else tree["lm_head"],
              "layers": tuple(tree["layers"][i] for i in range(config.num_hidden_layers))}
    return params


def engine_params(model: HybridCausalLM) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, params): the module's weights as the engine's params pytree, in the exact structure of
    `qnext.model.weights.param_specs(config)` (jax arrays, shared with the module, not copied)."""
    return model.config, as_engine_params(nnx.state(model, nnx.Param), model.config)


def from_pretrained(path: str | Path, dtype: Any = "float32") -> HybridCausalLM:
    """Loads a Hugging Face Qwen3-Next / Qwen3.5 / Qwen3.5-MoE checkpoint directory (any layout the engine
    loads) as a HybridCausalLM with weights in `dtype` (float32 or bfloat16; A_log and dt_bias stay float32)."""
    path = Path(path)
    checkpoint = load_checkpoint(path, dtype)
    source = SourceCheckpoint(json.dumps(read_json(path / "config.json"), sort_keys=True), str(path.resolve()))
    return HybridCausalLM(checkpoint.config, checkpoint.params, source)
