"""A prompt with images / videos -> what the text model takes besides its token ids: the 3-D positions, the
position delta that later tokens carry, which tokens the tower's output replaces, and that output."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from qnext.vision.config import VisionConfig, VisionTokenIds
from qnext.vision.mrope import mrope_positions, position_delta
from qnext.vision.preprocess import VisualInput
from qnext.vision.tower import make_encode


@dataclasses.dataclass(frozen=True, eq=False)
class VisualPrompt:
    rope_positions: np.ndarray   # [3, T] int32
    position_delta: int          # decode: RoPE position = token index + position_delta
    token_index: np.ndarray      # [N] int32: the image / video pad tokens, in order (N = sum of num_tokens)


def visual_prompt(token_ids: Sequence[int], visuals: Sequence[VisualInput], ids: VisionTokenIds,
                  cfg: VisionConfig) -> VisualPrompt:
    """visuals: the prompt's images and videos in the order they appear. ValueError when the prompt's pad tokens
    do not match them."""
    tokens = np.asarray(token_ids, np.int64)
    pads = np.flatnonzero((tokens == ids.image_token_id) | (tokens == ids.video_token_id)).astype(np.int32)
    expected = sum(v.num_tokens for v in visuals)
    if len(pads) != expected:
        raise ValueError(f"the prompt has {len(pads)} image / video pad tokens; its {len(visuals)} visual inputs "
                         f"need {expected}")
    positions = mrope_positions(tokens, [v.grid_thw for v in visuals], ids.image_token_id, ids.video_token_id,
                                cfg.spatial_merge_size)
    return VisualPrompt(positions, position_delta(positions), pads)


def encode_visuals(vision_params, visuals: Sequence[VisualInput], cfg: VisionConfig):
    """The tower's output for all of `visuals` in one call: [sum of num_tokens, out_hidden_size]."""
    if not visuals:
        return jnp.zeros((0, cfg.out_hidden_size), vision_params["pos_embed"].dtype)
    pixels = np.concatenate([v.pixel_values for v in visuals])
    return make_encode(cfg)(vision_params, pixels, tuple(v.grid_thw for v in visuals))


def batch_mrope_positions(input_ids, attention_mask, visuals_per_row: Sequence[Sequence[VisualInput]],
                          ids: VisionTokenIds, cfg: VisionConfig) -> np.ndarray:
    """[3, B, T] positions of a left-padded batch (the dense / Flax forward): each row's real tokens as
    mrope_positions has them, padding 0."""
    input_ids = np.asarray(input_ids)
    mask = np.ones(input_ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    out = np.zeros((3,) + input_ids.shape, np.int32)
    for b, visuals in enumerate(visuals_per_row):
        real = np.flatnonzero(mask[b])
        out[:, b, real] = visual_prompt(input_ids[b, real], visuals, ids, cfg).rope_positions
    return out
