"""A PEFT LoRA adapter as saved by `PeftModel.save_pretrained`: adapter_config.json + adapter_model.safetensors.

Read into per-module (A [r, in], B [out, r], scaling) with the HF module names of the base model (the VLM prefix
`model.language_model.` folded to `model.`, as the checkpoint loader does). The scaling is PEFT's: alpha / r, or
alpha / sqrt(r) with use_rslora; r and alpha per module from rank_pattern / alpha_pattern where they match (PEFT's
rule: a pattern key matches a module name that ends with it at a dot boundary, regexes allowed).

Refused with an error naming the field: another peft_type, DoRA, bias training, modules_to_save, target_parameters
(LoRA on raw parameters: routed experts), embedding / lm_head adapters, vision-tower modules.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_VLM_PREFIX = "model.language_model."


class AdapterError(ValueError):
    """An adapter that cannot be served as asked; the message names the file, field, tensor or limit."""


@dataclasses.dataclass(frozen=True)
class ModuleAdapter:
    a: np.ndarray          # [r, in] float32 (PEFT lora_A.weight)
    b: np.ndarray          # [out, r] float32 (PEFT lora_B.weight)
    scaling: float         # alpha / r (alpha / sqrt(r) with rslora)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    path: Path
    modules: dict[str, ModuleAdapter]   # HF module name (e.g. model.layers.0.linear_attn.in_proj_qkv) -> weights
    target_modules: tuple[str, ...] | str | None
    digest: str                          # sha256 of every module's name, weights and scaling: the adapter's identity

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter: {CONFIG_FILE} is missing")
    if not weights_file.is_file():
        raise AdapterError(f"{path} has no {WEIGHTS_FILE} (only the safetensors format is read)")
    config = json.loads(config_file.read_text())
    _check_config(config, config_file)

    from safetensors.numpy import load_file

    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", name)
        if match is None:
            kind = "embedding adapter" if "lora_embedding" in name else "tensor"
            raise AdapterError(f"{weights_file}: {kind} {key!r} is not a LoRA A / B weight this engine serves "
                               "(supported: lora_A.weight and lora_B.weight of linear layers)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = value
    if not pairs:
        raise AdapterError(f"{weights_file} holds no LoRA weights")

    r0, alpha0, rslora = int(config["r"]), float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules = {}
    for original in sorted(pairs):
        ab = pairs[original]
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{weights_file}: module {original!r} has {sorted(ab)} but needs lora_A and lora_B")
        a, b = (np.asarray(ab[k], np.float32) for k in ("lora_A", "lora_B"))
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{weights_file}: module {original!r} has lora_A {a.shape} and lora_B {b.shape}; "
                               "expected [r, in] and [out, r]")
        name = _model_name(original, weights_file)
        r = int(rank_pattern.get(_pattern_key(rank_pattern, original), r0))
        if r != a.shape[0]:
            raise AdapterError(f"{weights_file}: module {original!r} has rank {a.shape[0]}; the config says {r}")
        alpha = float(alpha_pattern.get(_pattern_key(alpha_pattern, original), alpha0))
        modules[name] = ModuleAdapter(a, b, alpha / (math.sqrt(r) if rslora else r))
    targets = config.get("target_modules")
    return PeftAdapter(path, modules, tuple(targets) if isinstance(targets, list) else targets, _digest(modules))


def _check_config(config: dict, file: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {config.get('peft_type')!r} is not served; only LORA")
    if "r" not in config:
        raise AdapterError(f"{file}: the field 'r' (the LoRA rank) is missing")
    if config.get("use_dora"):
        raise AdapterError(f"{file}: use_dora is true; DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias={config['bias']!r}; only adapters with bias 'none' are supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{file}: modules_to_save {config['modules_to_save']} is not supported (fully trained "
                           "copies of modules); save the adapter without them")
    if config.get("target_parameters"):
        raise AdapterError(f"{file}: target_parameters {config['target_parameters']} is not supported (LoRA on "
                           "raw parameters such as the routed experts)")
    if config.get("trainable_token_indices"):
        raise AdapterError(f"{file}: trainable_token_indices is not supported")


def _model_name(original: str, file: Path) -> str:
    if original.startswith(_VLM_PREFIX):
        return "model." + original[len(_VLM_PREFIX):]
    if original.startswith(("model.visual.", "visual.")):
        raise AdapterError(f"{file}: module {original!r} is in the vision tower; adapters on it are not supported")
    return original


def _pattern_key(patterns: dict, name: str) -> str | None:
    """PEFT's get_pattern_key: the first pattern key that `name` ends with at a dot boundary (as a regex)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def _digest(modules: dict[str, ModuleAdapter]) -> str:
    h = hashlib.sha256()
    for name in sorted(modules):
        m = modules[name]
        h.update(f"{name}|{m.a.shape}|{m.b.shape}|{m.scaling!r}|".encode())
        h.update(np.ascontiguousarray(m.a).tobytes())
        h.update(np.ascontiguousarray(m.b).tobytes())
    return h.hexdigest()
