"""Hugging Face config files -> the fields of qnext's ModelConfig (qnext/config.py builds the dataclass from them).

Covers Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5`, `qwen3_5_text`, `qwen3_5_moe`, `qwen3_5_moe_text`): the
model type check, the unwrapping of Qwen3.5's nested `text_config` (top-level tie and token ids fill what it lacks),
the layer pattern, the MoE fields per family, RoPE (HF 5.x `rope_parameters` or the legacy top-level fields), the
stop ids of generation_config.json, and errors that name the field. Plain JSON in, plain values out: this module
imports nothing of qnext.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)

MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_NESTED = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_ROPE_TYPES = ("default", "linear", "yarn")


def pretrained_fields(path: str | Path) -> dict[str, Any]:
    """The fields of `config.json` in a checkpoint directory (or the file itself). Extra stop ids from
    `generation_config.json` beside it are appended to `eos_token_ids`."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    fields = config_fields(read_json(config_file))
    gen_file = config_file.parent / "generation_config.json"
    if gen_file.exists():
        extra = _as_ids(read_json(gen_file).get("eos_token_id"), "eos_token_id", gen_file)
        eos = fields["eos_token_ids"]
        fields["eos_token_ids"] = eos + tuple(t for t in extra if t not in eos)
    return fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields of a parsed config.json object, checked; `rope_scaling` as RopeScaling's fields or None."""
    if not isinstance(hf, dict):
        raise ValueError(f"config must be a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {', '.join(MODEL_TYPES)}")
    text = hf
    if model_type in _NESTED:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"model_type {model_type!r} needs a 'text_config' object")
        text = {k: v for k, v in text.items() if v is not None}
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
            if key not in text and hf.get(key) is not None:
                text[key] = hf[key]
        text["model_type"] = _NESTED[model_type]
        if hf.get("tie_word_embeddings"):
            text["tie_word_embeddings"] = True
    return _text_fields(text, model_type)


def _text_fields(c: dict[str, Any], model_type: str) -> dict[str, Any]:
    text_type = c.get("model_type", model_type)
    family = "qwen3_next" if text_type == "qwen3_next" else ("moe" if "moe" in text_type else "dense")

    def req_int(name: str, minimum: int = 1) -> int:
        if c.get(name) is None:
            raise ValueError(f"config field {name!r} is missing")
        return _int(c[name], name, minimum)

    def opt_int(name: str, default: int, minimum: int = 0) -> int:
        return default if c.get(name) is None else _int(c[name], name, minimum)

    num_layers = req_int("num_hidden_layers")
    layer_types = c.get("layer_types")
    if layer_types is None:
        interval = opt_int("full_attention_interval", 4, 1)
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ValueError(f"config field 'layer_types' must list {num_layers} entries (num_hidden_layers)")
    for t in layer_types:
        if t not in LAYER_TYPES:
            raise ValueError(f"config field 'layer_types' has unknown layer type {t!r}; expected one of {LAYER_TYPES}")

    if family == "qwen3_next":
        num_experts = req_int("num_experts", 0)
    elif family == "moe":
        num_experts = req_int("num_experts", 1)
    else:
        num_experts = 0
    if num_experts:
        top_k = req_int("num_experts_per_tok")
        moe_size = req_int("moe_intermediate_size")
        shared_size = req_int("shared_expert_intermediate_size")
        if top_k > num_experts:
            raise ValueError(f"config field 'num_experts_per_tok' ({top_k}) exceeds num_experts ({num_experts})")
    else:
        top_k, moe_size, shared_size = 0, 0, 0
    if family == "qwen3_next":
        sparse_step = opt_int("decoder_sparse_step", 1, 1)
        mlp_only = tuple(_int(i, "mlp_only_layers", 0) for i in (c.get("mlp_only_layers") or ()))
        if any(i >= num_layers for i in mlp_only):
            raise ValueError(f"config field 'mlp_only_layers' {list(mlp_only)} names a layer >= {num_layers}")
        norm_topk = bool(c.get("norm_topk_prob", True))
    else:
        sparse_step, mlp_only, norm_topk = 1, (), True

    has_dense = any(
        not (num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0) for i in range(num_layers)
    )
    intermediate = req_int("intermediate_size") if has_dense else opt_int("intermediate_size", 0)

    max_pos = opt_int("max_position_embeddings", 32768, 1)
    rope_theta, partial_rotary, rope_scaling = _parse_rope(c, max_pos)
    fields = dict(
        model_type=model_type,
        vocab_size=req_int("vocab_size"),
        hidden_size=req_int("hidden_size"),
        num_hidden_layers=num_layers,
        layer_types=tuple(layer_types),
        num_attention_heads=req_int("num_attention_heads"),
        num_key_value_heads=req_int("num_key_value_heads"),
        head_dim=req_int("head_dim"),
        attention_bias=bool(c.get("attention_bias", False)),
        rope_theta=rope_theta,
        partial_rotary_factor=partial_rotary,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        rms_norm_eps=_float(c.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        linear_num_key_heads=req_int("linear_num_key_heads"),
        linear_num_value_heads=req_int("linear_num_value_heads"),
        linear_key_head_dim=req_int("linear_key_head_dim"),
        linear_value_head_dim=req_int("linear_value_head_dim"),
        linear_conv_kernel_dim=opt_int("linear_conv_kernel_dim", 4, 1),
        intermediate_size=intermediate,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_size,
        shared_expert_intermediate_size=shared_size,
        norm_topk_prob=norm_topk,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=mlp_only,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=None if c.get("bos_token_id") is None else _int(c["bos_token_id"], "bos_token_id", 0),
        eos_token_ids=_as_ids(c.get("eos_token_id"), "eos_token_id"),
        pad_token_id=None if c.get("pad_token_id") is None else _int(c["pad_token_id"], "pad_token_id", 0),
        mrope_section=_mrope_section(c, family),
    )
    _check_consistency(fields)
    return fields


def _parse_rope(c: dict[str, Any], max_pos: int) -> tuple[float, float, dict[str, Any] | None]:
    """HF 5.x `rope_parameters`, or legacy top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling`.
    As in HF, a legacy `rope_scaling` dict wins over `rope_parameters`, and values inside the dict win over
    top-level ones. The scaling comes back as the fields of qnext.config.RopeScaling (None: default RoPE)."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError("config field 'rope_parameters' must be an object")
    theta = _float(params.get("rope_theta", c.get("rope_theta", 10000.0)), "rope_theta")
    partial = _float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)), "partial_rotary_factor")
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"config field 'partial_rotary_factor' must be in (0, 1], got {partial}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"config field 'rope_type' {rope_type!r} is not supported; expected one of {_ROPE_TYPES}")
    if rope_type == "default":
        return theta, partial, None

    def opt(name: str) -> float | None:
        return None if params.get(name) is None else _float(params[name], name)

    factor = opt("factor")
    if rope_type == "linear" and factor is None:
        raise ValueError("config field 'factor' is missing for rope_type 'linear'")
    original = params.get("original_max_position_embeddings", c.get("original_max_position_embeddings"))
    if rope_type == "yarn" and original is None:
        original = max_pos
    scaling = dict(
        rope_type=rope_type,
        factor=factor,
        original_max_position_embeddings=(
            None if original is None else _int(original, "original_max_position_embeddings", 1)
        ),
        beta_fast=opt("beta_fast"),
        beta_slow=opt("beta_slow"),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
    return theta, partial, scaling


def _mrope_section(c: dict[str, Any], family: str) -> tuple[int, ...]:
    """Qwen3.5's interleaved MRoPE split of the rotary frequencies over (t, h, w); transformers' default
    [11, 11, 10] when the config has none. Qwen3-Next has no 3-D positions: ()."""
    if family == "qwen3_next":
        return ()
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    section = params.get("mrope_section", [11, 11, 10]) if isinstance(params, dict) else [11, 11, 10]
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise ValueError(f"config field 'mrope_section' must list 3 integers (t, h, w), got {section!r}")
    return tuple(_int(v, "mrope_section", 0) for v in section)


def _check_consistency(f: dict[str, Any]) -> None:
    if f["num_attention_heads"] % f["num_key_value_heads"]:
        raise ValueError(
            f"config field 'num_key_value_heads' ({f['num_key_value_heads']}) must divide "
            f"num_attention_heads ({f['num_attention_heads']})"
        )
    if f["linear_num_value_heads"] % f["linear_num_key_heads"]:
        raise ValueError(
            f"config field 'linear_num_key_heads' ({f['linear_num_key_heads']}) must divide "
            f"linear_num_value_heads ({f['linear_num_value_heads']})"
        )
    rotary_dim = int(f["head_dim"] * f["partial_rotary_factor"])     # ModelConfig.rotary_dim
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"config field 'partial_rotary_factor' ({f['partial_rotary_factor']}) gives rotary dim {rotary_dim} "
            f"for head_dim {f['head_dim']}; it must be even and positive"
        )


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config field {name!r} must be a number, got {value!r}")
    return float(value)


def _as_ids(value: Any, name: str, source: Path | None = None) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    where = f" in {source}" if source else ""
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"config field {name!r}{where} must be an integer or a list of integers, got {value!r}")
    return tuple(values)


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; expected a Hugging Face config file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
