"""The tiny vision tower of write_tiny_checkpoint(..., vlm=True): its vision_config, its preprocessing files and its
random weights under transformers' names and layouts (`model.visual.*`), which transformers' Qwen3.5 VL models load."""
from __future__ import annotations

from typing import Any

import numpy as np

TINY_VISION = {
    "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3, "patch_size": 4,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16, "hidden_act": "gelu_pytorch_tanh",
}
# The tiny tower's preprocessing (transformers' preprocessor_config.json): patch 4, so 8 x 8 pixels make one token;
# images of 64..4096 pixels (a 32 x 32 picture is 16 tokens, at most 64 tokens). Videos: no file, so the patch
# sizes and mean / std of this one with the video defaults (qnext/vision/preprocess_config.py).
TINY_IMAGE_PREPROCESSING = {
    "size": {"shortest_edge": 64, "longest_edge": 64 * 64}, "patch_size": 4, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
    "rescale_factor": 1 / 255, "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessor",
}


def vision_tensors(vc: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A tiny vision tower under `model.visual.` with transformers' names and layouts (qnext/vision runs it), every
    parameter random: LayerNorm scales around 1, matrices scaled by fan-in so the tower's output is not tiny."""
    hv, inter, merged = vc["hidden_size"], vc["intermediate_size"], vc["hidden_size"] * vc["spatial_merge_size"] ** 2
    shapes = {
        "patch_embed.proj.weight": (hv, vc["in_channels"], vc["temporal_patch_size"], *[vc["patch_size"]] * 2),
        "patch_embed.proj.bias": (hv,),
        "pos_embed.weight": (vc["num_position_embeddings"], hv),
        "merger.norm.weight": (hv,), "merger.norm.bias": (hv,),
        "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (vc["out_hidden_size"], merged), "merger.linear_fc2.bias": (vc["out_hidden_size"],),
    }
    for n in range(vc["depth"]):
        b = f"blocks.{n}."
        shapes.update({
            b + "norm1.weight": (hv,), b + "norm1.bias": (hv,), b + "norm2.weight": (hv,), b + "norm2.bias": (hv,),
            b + "attn.qkv.weight": (3 * hv, hv), b + "attn.qkv.bias": (3 * hv,),
            b + "attn.proj.weight": (hv, hv), b + "attn.proj.bias": (hv,),
            b + "mlp.linear_fc1.weight": (inter, hv), b + "mlp.linear_fc1.bias": (inter,),
            b + "mlp.linear_fc2.weight": (hv, inter), b + "mlp.linear_fc2.bias": (hv,),
        })
    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
            return (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)     # LayerNorm scale: around 1
        if name == "pos_embed.weight":
            return (0.5 * rng.standard_normal(shape)).astype(np.float32)
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 16
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    return {"model.visual." + k: draw(k, s) for k, s in shapes.items()}
