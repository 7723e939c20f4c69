"""The vision tower's weights (`model.visual.*`, the same names in Qwen3.5 dense and MoE VL checkpoints) ->
the tower's params pytree (qnext/vision/tower.py). The decoder's loader skips these tensors; a checkpoint without
them has no tower (load_vision_params returns None)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qnext.config import read_json
from qnext.model.loader import CheckpointError, checkpoint_files
from qnext.model.weights import as_dtype
from qnext.vision.config import VisionConfig, vision_configs

PREFIX = "model.visual."


def vision_param_shapes(cfg: VisionConfig) -> dict[str, Any]:
    """The params pytree's shapes, keyed as tower.py reads them, with each leaf's HF name and shape:
    {key: (hf name, hf shape)}; the patch embedding's Conv3d weight [hidden, C, tp, p, p] becomes [hidden, C*tp*p*p]."""
    hv, inter, merged = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit
    tree: dict[str, Any] = {
        "patch_embed": {
            "weight": ("patch_embed.proj.weight",
                       (hv, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)),
            "bias": ("patch_embed.proj.bias", (hv,)),
        },
        "pos_embed": ("pos_embed.weight", (cfg.num_position_embeddings, hv)),
        "merger": {
            "norm_weight": ("merger.norm.weight", (hv,)), "norm_bias": ("merger.norm.bias", (hv,)),
            "fc1_weight": ("merger.linear_fc1.weight", (merged, merged)), "fc1_bias": ("merger.linear_fc1.bias", (merged,)),
            "fc2_weight": ("merger.linear_fc2.weight", (cfg.out_hidden_size, merged)),
            "fc2_bias": ("merger.linear_fc2.bias", (cfg.out_hidden_size,)),
        },
    }
    blocks = []
    for n in range(cfg.depth):
        b = f"blocks.{n}."
        blocks.append({
            "norm1_weight": (b + "norm1.weight", (hv,)), "norm1_bias": (b + "norm1.bias", (hv,)),
            "qkv_weight": (b + "attn.qkv.weight", (3 * hv, hv)), "qkv_bias": (b + "attn.qkv.bias", (3 * hv,)),
            "proj_weight": (b + "attn.proj.weight", (hv, hv)), "proj_bias": (b + "attn.proj.bias", (hv,)),
            "norm2_weight": (b + "norm2.weight", (hv,)), "norm2_bias": (b + "norm2.bias", (hv,)),
            "fc1_weight": (b + "mlp.linear_fc1.weight", (inter, hv)), "fc1_bias": (b + "mlp.linear_fc1.bias", (inter,)),
            "fc2_weight": (b + "mlp.linear_fc2.weight", (hv, inter)), "fc2_bias": (b + "mlp.linear_fc2.bias", (hv,)),
        })
    tree["blocks"] = tuple(blocks)
    return tree


def has_vision_tower(path: str | Path) -> bool:
    """Whether the checkpoint's config declares a vision tower and its files hold `model.visual.*` tensors."""
    path = Path(path)
    if vision_configs(read_json(path / "config.json")) is None:
        return False
    return bool(_visual_tensor_files(path))


def load_vision_params(path: str | Path, dtype: Any = "float32", place=None) -> dict[str, Any] | None:
    """The tower's params of the checkpoint in `path` (numpy, or `place(array)` per leaf), or None when the
    checkpoint has no tower. CheckpointError when a tensor is missing, mis-shaped or unexpected."""
    path = Path(path)
    configs = vision_configs(read_json(path / "config.json"))
    files = _visual_tensor_files(path)
    if configs is None or not files:
        return None
    from safetensors import safe_open

    arrays: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as handle:
            for name in handle.keys():
                if name.startswith(PREFIX):
                    arrays[name[len(PREFIX):]] = handle.get_tensor(name)
    return vision_params_from_tensors(arrays, configs[0], dtype, place, where=str(path))


def vision_params_from_tensors(arrays: dict[str, np.ndarray], cfg: VisionConfig, dtype: Any = "float32", place=None,
                               where: str = "the given tensors") -> dict[str, Any]:
    """The params pytree from the tower's tensors named as under `model.visual.` (without the prefix), as a
    transformers Qwen3_5VisionModel's state dict names them."""
    dt = as_dtype(dtype)
    used: set[str] = set()

    def build(leaf):
        if isinstance(leaf, dict):
            return {k: build(v) for k, v in leaf.items()}
        if isinstance(leaf, tuple) and leaf and isinstance(leaf[0], dict):
            return tuple(build(v) for v in leaf)
        name, shape = leaf
        if name not in arrays:
            raise CheckpointError(f"vision tensor {PREFIX + name!r} is missing from {where}")
        if tuple(arrays[name].shape) != shape:
            raise CheckpointError(f"vision tensor {PREFIX + name!r} has shape {tuple(arrays[name].shape)}; the "
                                  f"vision_config expects {shape}")
        used.add(name)
        arr = np.ascontiguousarray(np.asarray(arrays[name]).reshape(shape[0], -1) if name == "patch_embed.proj.weight"
                                   else arrays[name], dtype=dt)
        return place(arr) if place is not None else arr

    params = build(vision_param_shapes(cfg))
    unexpected = sorted(set(arrays) - used)
    if unexpected:
        raise CheckpointError(f"unexpected vision tensor {PREFIX + unexpected[0]!r} (and {len(unexpected) - 1} more); "
                              "does the vision_config match the checkpoint?")
    return params


def replaced_vision_params(placed: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """New tower weights (the same structure and shapes as `placed`; any float dtype) cast to `placed`'s dtypes and
    put where `placed` lies; ValueError saying what differs."""
    import jax

    if jax.tree.structure(placed) != jax.tree.structure(new):
        raise ValueError(f"the new vision tower params have structure {jax.tree.structure(new)}; the engine's tower "
                         f"has {jax.tree.structure(placed)} (qnext.flax.vision_params gives it)")
    for (path, old), leaf in zip(jax.tree_util.tree_leaves_with_path(placed), jax.tree.leaves(new)):
        if tuple(np.shape(leaf)) != tuple(old.shape):
            raise ValueError(f"the new vision tower param {jax.tree_util.keystr(path)} has shape "
                             f"{tuple(np.shape(leaf))}; the engine's tower has {tuple(old.shape)}")
    return jax.tree.map(lambda old, leaf: jax.device_put(jax.numpy.asarray(leaf, old.dtype), old.sharding), placed, new)


def _visual_tensor_files(path: Path) -> list[Path]:
    from safetensors import safe_open

    out = []
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="numpy") as handle:
            if any(name.startswith(PREFIX) for name in handle.keys()):
                out.append(f)
    return out


def to_hf_vision_tensors(params: dict[str, Any], cfg: VisionConfig) -> dict[str, np.ndarray]:
    """The inverse of load_vision_params: HF names (`model.visual.*`) and layouts, as numpy arrays."""
    out: dict[str, np.ndarray] = {}

    def walk(spec, value):
        if isinstance(spec, dict):
            for k in spec:
                walk(spec[k], value[k])
        elif isinstance(spec, tuple) and spec and isinstance(spec[0], dict):
            for s, v in zip(spec, value):
                walk(s, v)
        else:
            name, shape = spec
            out[PREFIX + name] = np.asarray(value).reshape(shape)

    walk(vision_param_shapes(cfg), params)
    return out
