"""`save_pretrained(model, out_dir)`: a HybridCausalLM back to a Hugging Face checkpoint in its source's layout.

Writes config.json (the source's, with its dtype), model.safetensors (or shards + index) named and laid out as
the source family stores them (qnext/model/hf_export.py), and, when the module knows its source directory, the
source's other files (tokenizer, generation config, chat template) and the tensors the engine does not load
(`model.visual.*`, `mtp.*`) unchanged, so transformers, vLLM and qnext load the result as they loaded the source.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from qnext.flax.model import HybridCausalLM, engine_params, vision_params
from qnext.model.hf_export import TEXT_PREFIX, VLM_TEXT_PREFIX, to_hf_tensors
from qnext.model.loader import INDEX_FILE, SINGLE_FILE, checkpoint_files
from qnext.model.vision_weights import PREFIX as VISION_PREFIX, to_hf_vision_tensors

PASS_THROUGH_PREFIXES = ("model.visual.", "mtp.")   # stored by the source, not used by the engine: copied as is
_NOT_COPIED = {"config.json", INDEX_FILE}
MAX_SHARD_BYTES = 5 * 2**30


def save_pretrained(model: HybridCausalLM, out_dir: str | Path, *, fused_experts: bool | None = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Writes the model as a Hugging Face checkpoint directory and returns its path. Experts are written as the
    source stored them (fused_experts=None), else fused (True) or per expert (False). Tensors keep the model
    dtype (A_log and dt_bias are float32, as the engine holds them)."""
    out = Path(out_dir)
    source_dir = Path(model.source.directory) if model.source.directory else None
    if source_dir is not None and out.resolve() == source_dir:
        raise ValueError(f"{out} is the model's source checkpoint; save to another directory")
    hf_config = model.source.hf_config
    cfg, params = engine_params(model)
    params = jax.device_get(params)
    pass_through = _pass_through_tensors(source_dir) if source_dir is not None else {}
    if fused_experts is None:
        fused_experts = source_dir is not None and _has_fused_experts(source_dir)
    prefix = VLM_TEXT_PREFIX if "text_config" in hf_config else TEXT_PREFIX
    tensors = to_hf_tensors(params, cfg, prefix=prefix, fused_experts=fused_experts)
    tensors.update(pass_through)
    if model.vision is not None:                   # the tower as trained, not the source's copy
        tensors = {k: v for k, v in tensors.items() if not k.startswith(VISION_PREFIX)}
        tensors.update(to_hf_vision_tensors(jax.device_get(vision_params(model)), model.vision.config))

    out.mkdir(parents=True, exist_ok=True)
    if source_dir is not None:
        for f in sorted(source_dir.iterdir()):
            if f.is_file() and f.suffix != ".safetensors" and f.name not in _NOT_COPIED:
                shutil.copy2(f, out / f.name)
    dtype_name = np.dtype(params["embed"].dtype).name
    for section in (hf_config, hf_config.get("text_config") or {}):
        section["dtype"] = dtype_name
        if "torch_dtype" in section:               # the name before transformers 5
            section["torch_dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    write_safetensors(out, tensors, max_shard_bytes)
    return out


def write_safetensors(out: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors shards of about max_shard_bytes + the index.
    Replaces any weight files already in `out`."""
    from safetensors.numpy import save_file

    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": int(total)}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _source_names(source_dir: Path) -> dict[str, Path]:
    from safetensors import safe_open

    names = {}
    for f in checkpoint_files(source_dir):
        with safe_open(str(f), framework="numpy") as handle:
            names.update(dict.fromkeys(handle.keys(), f))
    return names


def _has_fused_experts(source_dir: Path) -> bool:
    return any(n.endswith("experts.gate_up_proj") for n in _source_names(source_dir))


def _pass_through_tensors(source_dir: Path) -> dict[str, Any]:
    from safetensors import safe_open

    out = {}
    for name, f in _source_names(source_dir).items():
        if name.startswith(PASS_THROUGH_PREFIXES):
            with safe_open(str(f), framework="numpy") as handle:
                out[name] = handle.get_tensor(name)
    return out
