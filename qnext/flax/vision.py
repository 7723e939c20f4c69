"""The vision tower as Flax NNX state beside the text model: `VisionTower` holds the tower's params
(qnext/vision/tower.py layout) as nnx.Param leaves, so an image-text loss differentiates through the tower too.

    model = qnext.flax.from_pretrained(path)              # a VL checkpoint: model.vision is a VisionTower
    visuals = [preprocess_image(img, image_config)]        # qnext.vision.preprocess
    batch = image_batch(model, input_ids, attention_mask, [visuals_of_row_0, ...])   # host side, outside jit
    logits = model(input_ids, attention_mask, **batch)
"""
from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qnext.flax.param_group import ParamGroup
from qnext.vision.config import VisionConfig, VisionTokenIds
from qnext.vision.preprocess import VisualInput
from qnext.vision.prompt_inputs import batch_mrope_positions
from qnext.vision.tower import as_grids


class VisionTower(nnx.Module):
    def __init__(self, config: VisionConfig, token_ids: VisionTokenIds, params: dict[str, Any]):

        self.config = config
        self.token_ids = token_ids
        self.patch_embed = ParamGroup(params["patch_embed"])
        self.pos_embed = nnx.Param(jnp.asarray(params["pos_embed"]))
        self.blocks = nnx.List([ParamGroup(b) for b in params["blocks"]])
        self.merger = ParamGroup(params["merger"])


def as_vision_params(tree: dict[str, Any], config: VisionConfig) -> dict[str, Any]:
    """A VisionTower's Param state (values or gradients, as a pure dict) as tower.py's params pytree (no copies)."""
    return {"patch_embed": tree["patch_embed"], "pos_embed": tree["pos_embed"], "merger": tree["merger"],
            "blocks": tuple(tree["blocks"][i] for i in range(config.depth))}


def image_batch(model, input_ids, attention_mask, visuals_per_row: Sequence[Sequence[VisualInput]]) -> dict:
    """Host-side inputs of `model(input_ids, attention_mask, **batch)` for a left-padded batch whose rows hold
    the images / videos `visuals_per_row` (each row's in prompt order): pixel_values [P, C*tp*p*p], grid_thw (one
    (t, h, w) per input, rows in order; static under jit) and rope_positions [3, B, T]."""
    if model.vision is None:
        raise ValueError("this checkpoint has no vision tower (no vision_config / model.visual.* tensors)")
    tower = model.vision
    flat = [v for row in visuals_per_row for v in row]
    if not flat:
        raise ValueError("no images or videos given; call the model with input_ids and attention_mask only")
    return {"pixel_values": np.concatenate([v.pixel_values for v in flat]),
            "grid_thw": as_grids([v.grid_thw for v in flat]),
            "rope_positions": batch_mrope_positions(input_ids, attention_mask, visuals_per_row, tower.token_ids,
                                                    tower.config)}
