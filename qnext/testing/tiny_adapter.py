"""Tiny random PEFT LoRA adapters (no torch needed), for the server tests and the bench.

`write_tiny_adapter(out, checkpoint)` writes what `PeftModel.save_pretrained` writes (adapter_config.json and
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` / `lora_B.weight`) for every adaptable
linear of the checkpoint's model (qnext/lora/adapter_weights.py: leaf_targets), or the ones named in `targets`.
Unlike PEFT's fresh adapters, lora_B is random too, so the adapter changes the model's outputs. Exactness against
PEFT itself is tested with PEFT (tests/lora/test_lora_vs_peft.py); these files only need to be valid adapters.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from qnext.config import ModelConfig
from qnext.lora.adapter_weights import leaf_targets


def write_tiny_adapter(out: str | Path, checkpoint: str | Path, *, rank: int = 4, alpha: float = 8.0,
                       seed: int = 0, scale: float = 0.3, targets: tuple[str, ...] | None = None) -> Path:
    """targets: short module names (q_proj, in_proj_b, ...); None: every adaptable linear."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors, names = {}, set()
    for leaf in leaf_targets(ModelConfig.from_pretrained(checkpoint)):
        for module, rows in zip(leaf.modules, leaf.module_rows):
            short = module.rsplit(".", 1)[-1]
            if targets is not None and short not in targets:
                continue
            names.add(short)
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, leaf.in_features)) * scale).astype(
                np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((rows, rank)) * scale).astype(np.float32)
    if not tensors:
        raise ValueError(f"none of targets {targets} is an adaptable linear of {checkpoint}")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(names),
              "bias": "none", "lora_dropout": 0.0, "base_model_name_or_path": str(checkpoint)}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out
