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
from qnext.model.vision_weights import load_vision_params
from qnext.flax.param_group import ParamGroup
from qnext.flax.vision import VisionTower, as_vision_params
from qnext.vision.config import vision_configs
from qnext.vision.tower import as_grids, encode


@dataclasses.dataclass(frozen=True)
class SourceCheckpoint:
    """Where the weights came from: the checkpoint's config.json (as text, so the module stays hashable) and its
    directory when there is one (for the tokenizer files and the tensors the engine skips, on save)."""

    hf_config_json: str
    directory: str | None = None

    @property
    def hf_config(self) -> dict[str, Any]:
        return json.loads(self.hf_config_json)


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

    def __init__(self, config: ModelConfig, params: dict[str, Any], source: SourceCheckpoint,
                 vision: "VisionTower | None" = None):
        if config.tensor_parallel_size != 1:
            raise ValueError("HybridCausalLM holds a whole model; got a tensor-parallel shard config")
        self.config = config
        self.source = source
        self.embed = nnx.Param(jnp.asarray(params["embed"]))
        self.final_norm = nnx.Param(jnp.asarray(params["final_norm"]))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.asarray(params["lm_head"]))
        self.layers = nnx.List([DecoderLayer(layer) for layer in params["layers"]])
        self.vision = vision                      # the image / video tower of a VL checkpoint (qnext/flax/vision.py)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, grid_thw=None, rope_positions=None):
        """Text: input_ids [B, T], attention_mask [B, T]. Images / video (qnext.flax.vision.image_batch builds
        them): pixel_values [P, C*tp*p*p] of every input in row order, grid_thw their (t, h, w) (static), and
        rope_positions [3, B, T]; the tower's output replaces the image / video pad tokens."""
        params = engine_params(self)[1]
        if pixel_values is None:
            return dense_forward(params, input_ids, attention_mask, self.config, rope_positions=rope_positions)
        if self.vision is None or grid_thw is None or rope_positions is None:
            raise ValueError("images need a VL checkpoint's vision tower, grid_thw and rope_positions "
                             "(qnext.flax.vision.image_batch)")
        tower = self.vision
        embeds = encode(as_vision_params(nnx.to_pure_dict(nnx.state(tower, nnx.Param)), tower.config),
                        jnp.asarray(pixel_values), as_grids(grid_thw), tower.config)
        ids = jnp.asarray(input_ids)
        pads = (ids == tower.token_ids.image_token_id) | (ids == tower.token_ids.video_token_id)
        if attention_mask is not None:
            pads = pads & jnp.asarray(attention_mask).astype(bool)
        return dense_forward(params, input_ids, attention_mask, self.config, visual_embeds=embeds, visual_mask=pads,
                             rope_positions=rope_positions)


def vision_params(model: HybridCausalLM) -> dict[str, Any] | None:
    """The tower's params pytree (qnext/vision/tower.py), a view of the module's state; None without a tower."""
    if model.vision is None:
        return None
    return as_vision_params(nnx.to_pure_dict(nnx.state(model.vision, nnx.Param)), model.vision.config)


def as_engine_params(state: nnx.State, config: ModelConfig) -> dict[str, Any]:
    """The Param state of a HybridCausalLM (its values, or gradients of the same structure) as the engine's params
    pytree: the same arrays, no copies; lm_head is embed when the embeddings are tied."""
    tree = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
    # the vision tower's state, when there is one, is not part of the engine's params (vision_params)
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
    hf_config = read_json(path / "config.json")
    source = SourceCheckpoint(json.dumps(hf_config, sort_keys=True), str(path.resolve()))
    vision = None
    tower_params = load_vision_params(path, dtype)
    if tower_params is not None:
        vision = VisionTower(*vision_configs(hf_config), tower_params)
    return HybridCausalLM(checkpoint.config, checkpoint.params, source, vision)
