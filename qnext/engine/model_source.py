"""Where an engine's model comes from: a checkpoint directory (weights placed and sharded as they load, the
tokenizer, the MTP head when the engine speculates, the vision tower when the checkpoint has one), and the model
config as the engine runs it (kernels and layouts chosen once)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax

from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig, resolved_fp8_weights
from qnext.engine.visual_encoder import VisionSetup
from qnext.engine.visual_intake import vision_setup
from qnext.engine.weights_identity import WeightsIdentity
from qnext.model.checkpoint import load_checkpoint
from qnext.model.loader import checkpoint_files
from qnext.model.mtp import MTP_FILE
from qnext.tokenizer import Tokenizer


@dataclasses.dataclass
class ModelSource:
    cfg: ModelConfig
    params: Any                        # placed on the engine's devices
    tokenizer: Tokenizer | None
    mtp: Any                           # the MTP head's params (None: the engine does not speculate)
    vision: VisionSetup | None
    identity: WeightsIdentity


def load_model_source(model: Path, config: EngineConfig, progress: Callable[[str], Any] | None) -> ModelSource:
    tokenizer = Tokenizer.from_pretrained(model) if (model / "tokenizer.json").is_file() else None
    (progress or (lambda msg: None))("loading weights")
    checkpoint = load_checkpoint(model, config.dtype, tensor_parallel_size=config.tensor_parallel_size,
                                 expert_parallel=config.enable_expert_parallel,
                                 attention_tensor_parallel=config.attention_tensor_parallel,
                                 with_mtp=config.uses_mtp_head, with_vision=True,
                                 fp8_weights=resolved_fp8_weights(config.fp8_weights, jax.default_backend()))
    if config.uses_mtp_head and checkpoint.mtp is None:
        raise ValueError(f"speculative_config {config.speculative_config} drafts with the checkpoint's MTP "
                         f"head, but {model} has none (no mtp.* tensors, no {MTP_FILE}); train one with "
                         "scripts/train_mtp.py or drop speculative_config")
    persisted = config.prefix_cache_dir is not None and config.enable_prefix_caching
    identity = WeightsIdentity(checkpoint_files(model), config.prefix_cache_dir if persisted else None)
    return ModelSource(checkpoint.config, checkpoint.params, tokenizer, checkpoint.mtp,
                       vision_setup(model, checkpoint.vision), identity)


def running_config(cfg: ModelConfig, config: EngineConfig) -> ModelConfig:
    """The model config as the engine runs it: the backend's kernels and layouts, chosen once for every layer and
    step (on GPU, Pallas Mosaic GPU or Triton, logged: pallas_kernels/backend_choice.py), and the KV cache's
    scale."""
    cfg = dataclasses.replace(cfg.with_backend(), kv_cache_scale=float(config.kv_cache_scale))
    if cfg.backend == "gpu":
        from pallas_kernels.backend_choice import resolve_gpu_kernel_backend
        cfg = dataclasses.replace(cfg, gpu_kernels=resolve_gpu_kernel_backend(config.gpu_kernel_backend))
    return cfg
