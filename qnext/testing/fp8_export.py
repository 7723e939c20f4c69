"""A synthetic FP8 release: quantises a bf16 / float32 checkpoint into the format of Qwen's `*-FP8` checkpoints, so
every family and layout is tested (and benched) without downloads.

As in the releases: every linear weight becomes e4m3 with a float32 `weight_scale_inv` per block
(`weight_block_size`, [128, 128] by default; a smaller block makes a tiny model's dims span several blocks with
partial edge blocks), and the release's ignore list stays in the source dtype and is written to
`quantization_config.modules_to_not_convert` as module paths in the checkpoint's own layout: lm_head, the embeddings,
the MoE router `mlp.gate`, `shared_expert_gate`, `conv1d`, the decay-gate projections `in_proj_a` / `in_proj_b`
(Qwen3-Next: `in_proj_ba`), `mtp.*` and `model.visual.*`. Norms, A_log and dt_bias are vectors and never quantised.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from qnext.model.fp8_blocks import dequantize, quantize, scale_name, text_only_name
from qnext.model.loader import checkpoint_files
from qnext.model.safetensors_fp8 import FLOAT8_DTYPES, Float8File
from qnext.testing.tiny_checkpoint import _write_safetensors

RELEASE_BLOCK_SIZE = (128, 128)
_UNQUANTISED_MODULES = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "conv1d", "in_proj_a",
                        "in_proj_b", "in_proj_ba")
_UNQUANTISED_PREFIXES = ("mtp", "model.visual")
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def export_fp8(src: str | Path, out: str | Path, block_size: tuple[int, int] = RELEASE_BLOCK_SIZE) -> Path:
    """Writes the FP8 version of the checkpoint in `src` into `out` (config, tokenizer and generation files copied;
    the config gains the release's `quantization_config`). Returns `out`."""
    src, out = Path(src), Path(out)
    tensors = read_tensors(src)
    quantised, not_converted = {}, set()
    for name, w in tensors.items():
        module = _module(name)
        if _left_unquantised(name):
            not_converted.add(module if not name.startswith(_UNQUANTISED_PREFIXES) else
                              next(p for p in _UNQUANTISED_PREFIXES if name.startswith(p + ".")))
            quantised[name] = w
        elif _is_linear_weight(name, w):
            quantised[name], quantised[scale_name(name)] = quantize(w, block_size)
        else:
            quantised[name] = w
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block_size),
        "modules_to_not_convert": sorted(not_converted),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_safetensors(out, dict(sorted(quantised.items())), num_shards=1)
    return out


def export_dequantized(fp8_dir: str | Path, out: str | Path) -> Path:
    """Writes the FP8 checkpoint in `fp8_dir` back as an unquantised float32 checkpoint (W = Q * S per block; the
    modules left in bf16 widened exactly): the reference an FP8 load must equal."""
    fp8_dir, out = Path(fp8_dir), Path(out)
    config = json.loads((fp8_dir / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    tensors = read_tensors(fp8_dir)
    plain = {name: (dequantize(w, tensors[scale_name(name)], block) if w.dtype.name.startswith("float8") else
                    np.asarray(w, np.float32))
             for name, w in tensors.items() if not name.endswith("_scale_inv")}
    out.mkdir(parents=True, exist_ok=True)
    for f in fp8_dir.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_safetensors(out, plain, num_shards=1)
    return out


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    tensors = {}
    for f in checkpoint_files(path):
        float8 = None
        with safe_open(str(f), framework="numpy") as handle:
            for name in handle.keys():
                if handle.get_slice(name).get_dtype() in FLOAT8_DTYPES:
                    float8 = float8 or Float8File(f)
                    tensors[name] = float8.read(name)
                else:
                    tensors[name] = handle.get_tensor(name)
    return tensors


def _module(name: str) -> str:
    return name[:-len(".weight")] if name.endswith(".weight") else name


def _left_unquantised(name: str) -> bool:
    if name.startswith(tuple(p + "." for p in _UNQUANTISED_PREFIXES)):
        return True
    module = text_only_name(_module(name))
    return any(module == m or module.endswith("." + m) for m in _UNQUANTISED_MODULES)


def _is_linear_weight(name: str, w: np.ndarray) -> bool:
    return (name.endswith(".weight") and w.ndim == 2) or (name.endswith(_FUSED_EXPERTS) and w.ndim == 3)
