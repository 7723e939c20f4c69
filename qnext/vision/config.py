"""The vision tower's config and the vision token ids, from a Qwen3.5 VL checkpoint's config.json.

`VisionConfig.from_hf(config["vision_config"])` mirrors transformers' Qwen3_5VisionConfig (and the MoE one, which
is the same tower): a Qwen3-VL ViT without deepstack. Frozen and hashable: a static argument under `jax.jit`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

VISION_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584            # the text model's hidden size
    num_position_embeddings: int = 2304    # a square grid of learned embeddings, bilinearly resampled per image
    rope_theta: float = 10000.0            # the 2-D (h, w) vision RoPE
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, vision_config: dict[str, Any]) -> "VisionConfig":
        """From the `vision_config` object of config.json; ValueError naming a wrong field."""
        if not isinstance(vision_config, dict):
            raise ValueError(f"vision_config must be a JSON object, got {type(vision_config).__name__}")
        defaults = cls()
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("rope_theta", "layer_norm_eps"):
                continue
            raw = vision_config.get(f.name, getattr(defaults, f.name))
            if f.name == "hidden_act":
                if raw not in ("gelu_pytorch_tanh", "gelu"):
                    raise ValueError(f"vision_config field 'hidden_act' {raw!r} is not supported; expected "
                                     "'gelu_pytorch_tanh' or 'gelu'")
                values[f.name] = raw
                continue
            if isinstance(raw, (list, tuple)) and len(set(raw)) == 1:   # transformers allows [p, p]
                raw = raw[0]
            if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
                raise ValueError(f"vision_config field {f.name!r} must be a positive integer, got {raw!r}")
            values[f.name] = raw
        rope = vision_config.get("rope_parameters") or {}
        values["rope_theta"] = float(rope.get("rope_theta", vision_config.get("rope_theta", defaults.rope_theta)))
        cfg = cls(**values)
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ValueError(f"vision_config hidden_size {cfg.hidden_size} / num_heads {cfg.num_heads} must give a "
                             "head dim divisible by 4 (the 2-D RoPE splits it in h and w halves of cos/sin pairs)")
        side = int(round(cfg.num_position_embeddings ** 0.5))
        if side * side != cfg.num_position_embeddings:
            raise ValueError(f"vision_config num_position_embeddings {cfg.num_position_embeddings} is not a square")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one row of pixel_values: C * temporal_patch * patch * patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one text token."""
        return self.spatial_merge_size ** 2

    @property
    def position_grid_side(self) -> int:
        return int(round(self.num_position_embeddings ** 0.5))


@dataclasses.dataclass(frozen=True)
class VisionTokenIds:
    """The prompt's vision tokens (config.json top level): one image_token per merged patch of an image, one
    video_token per merged patch of a video frame, each image or frame between vision_start and vision_end."""

    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "VisionTokenIds":
        defaults = cls()
        values = {}
        for f in dataclasses.fields(cls):
            raw = config.get(f.name, getattr(defaults, f.name))
            if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
                raise ValueError(f"config field {f.name!r} must be a token id (integer >= 0), got {raw!r}")
            values[f.name] = raw
        return cls(**values)


def vision_configs(config: dict[str, Any]) -> tuple[VisionConfig, VisionTokenIds] | None:
    """(tower config, token ids) of a parsed config.json, or None for a text-only checkpoint config."""
    if config.get("model_type") not in VISION_MODEL_TYPES or not isinstance(config.get("vision_config"), dict):
        return None
    return VisionConfig.from_hf(config["vision_config"]), VisionTokenIds.from_hf(config)
