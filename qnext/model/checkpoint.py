"""A Hugging Face checkpoint directory -> the model's config and its weights placed on the engine's devices: the one
load path, which the engine (`LLM(path)`), the Flax front end (`qnext.flax.from_pretrained`) and scoring
(`qnext.load_model`) share.

One device: the weights are converted tensor by tensor and each is committed to the engine's first device as soon
as it is built (loader.load_params, optionally through the converted-params cache). Tensor parallelism: the whole
checkpoint is converted in host memory and each device gets only its shard (placement.place_params).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from qnext.config import ModelConfig
from qnext.model.host_devices import engine_devices
from qnext.model.loader import convert_checkpoint, load_params
from qnext.model.mtp import load_mtp_params
from qnext.model.placement import place_params
from qnext.model.tensor_parallel import parallel_config
from qnext.model.vision_weights import load_vision_params
from qnext.model.weights import as_dtype


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig          # the global config with the parallel layout (tensor_parallel.parallel_config)
    params: dict[str, Any]       # placed: committed to the engine's first device, or sharded over its mesh
    mtp: dict[str, Any] | None   # the MTP head (model/mtp.py) when asked for and the checkpoint has one
    vision: dict[str, Any] | None = None  # the vision tower (qnext/vision/tower.py) when asked for and present,
                                          # on the engine's first device (replicated under tensor parallelism)


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a checkpoint directory: config.json is missing")
    return ModelConfig.from_pretrained(path)


def load_checkpoint(path: str | Path, dtype: Any = "float32", *, tensor_parallel_size: int = 1,
                    expert_parallel: bool = False, attention_tensor_parallel: bool = True, with_mtp: bool = False,
                    cache_dir: str | Path | None = None, with_vision: bool = False,
                    fp8_weights: str = "dequantize") -> Checkpoint:
    """Reads the checkpoint in `path` with weights in `dtype` (float32 or bfloat16; A_log and dt_bias stay
    float32), placed for `tensor_parallel_size` devices; the parallel layout is checked against the model before
    any tensor is read. with_mtp: the MTP head too (None when the checkpoint has none). cache_dir: the
    converted-params cache (loader.load_params; one device only). with_vision: the vision tower too (None when
    the checkpoint has none). fp8_weights: "keep" holds an FP8 checkpoint's weights as e4m3 with block scales
    (loader.convert_checkpoint), "dequantize" widens them at load."""
    path, dt = Path(path), as_dtype(dtype)
    cfg = parallel_config(read_config(path), tensor_parallel_size, expert_parallel, attention_tensor_parallel)
    if tensor_parallel_size > 1:
        if cache_dir is not None:
            raise ValueError("cache_dir stores one device's converted params; drop it with tensor_parallel_size > 1")
        params = place_params(convert_checkpoint(path, cfg, dt, fp8_weights=fp8_weights), cfg, dt,
                              tensor_parallel_size)
    else:
        params = load_params(path, cfg, dt, cache_dir=cache_dir, fp8_weights=fp8_weights)
    vision = None
    if with_vision:
        import jax

        device = engine_devices()[0]
        vision = load_vision_params(path, dt, place=lambda a: jax.device_put(a, device))
    return Checkpoint(cfg, params, load_mtp_params(path, cfg, dt) if with_mtp else None, vision)
