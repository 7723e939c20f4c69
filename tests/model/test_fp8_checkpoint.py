"""FP8 checkpoints as released (qnext/model/fp8_blocks.py, the loader): every family's synthetic FP8 export
(qnext/testing/fp8_export.py) loads to exactly the weights of its float32 dequantised copy, under the text-only and
the VLM layouts, packed and split projections, per-expert and fused experts; the modules the release leaves in bf16
load unchanged; malformed checkpoints are errors that name the tensor."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from qnext.config import ModelConfig
from qnext.model.dense import dense_forward
from qnext.model.fp8_blocks import Fp8Scheme, dequantize, quantize
from qnext.model.loader import CheckpointError, convert_checkpoint
from qnext.testing.fp8_export import export_dequantized, export_fp8, read_tensors
from tests.support.trees import assert_same_tree

# 48 splits the tiny dims (64, 96, 128, ...) into several blocks with partial edge blocks; 128 is the release's
CASES = {
    "qwen3_next": dict(family="qwen3_next", block=(48, 48)),                       # packed qkvz / ba, per expert
    "qwen3_next_fused": dict(family="qwen3_next", block=(128, 128), fused_experts=True),
    "qwen3_5_vlm": dict(family="qwen3_5", block=(48, 32), vlm=True),               # split projections, VLM names
    "qwen3_5_moe": dict(family="qwen3_5_moe", block=(48, 48), fused_experts=True),
    "qwen3_5_moe_vlm": dict(family="qwen3_5_moe", block=(32, 48), vlm=True),
}
# FP8 vs the bf16 original: e4m3 keeps 3 mantissa bits (relative error <= 1/16 per weight, ~3% typical). Through the
# tiny random models' four layers the logits (|logit| <= ~5) moved by 0.075-0.086 on average and 0.9-2.2 at most
# when measured (random tiny weights amplify perturbations more than trained ones); the bounds leave some room
MEAN_LOGIT_ERROR_VS_BF16, MAX_LOGIT_ERROR_VS_BF16 = 0.12, 3.0
_forward = jax.jit(dense_forward, static_argnums=3)


def _export(tmp_path, name):
    case = dict(CASES[name])
    family, block = case.pop("family"), case.pop("block")
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "bf16", family, seed=5, dtype="bfloat16", **case)
    fp8 = export_fp8(src, tmp_path / "fp8", block_size=block)
    return src, fp8


def _logits(path, params):
    cfg = ModelConfig.from_pretrained(path)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 24))
    return np.asarray(_forward(params, ids, np.ones_like(ids), cfg))


def test_quantize_bounds_error_per_block_and_keeps_block_orientation():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 300)).astype(np.float32) * np.linspace(0.01, 3, 300)  # columns of rising scale
    q, scale = quantize(w, (128, 128))
    assert q.dtype.name == "float8_e4m3fn" and scale.shape == (2, 3) and scale.dtype == np.float32
    assert np.all(scale[:, 2] > scale[:, 0])  # blocks follow [row block, column block]
    back = dequantize(q, scale, (128, 128))
    step = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200, :300]
    assert np.all(np.abs(back - w) <= np.abs(w) / 16 + step / 2 ** 9)
    ones = np.ones((130, 5), np.float32).astype(q.dtype)
    np.testing.assert_array_equal(dequantize(ones, np.array([[2.0], [3.0]], np.float32), (128, 128))[[0, 127, 128, 129], 0],
                                  [2, 2, 3, 3])


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_export_loads_as_its_dequantised_copy(tmp_path, name):
    src, fp8 = _export(tmp_path, name)
    cfg = ModelConfig.from_pretrained(fp8)
    loaded = convert_checkpoint(fp8, cfg, "float32")
    reference = convert_checkpoint(export_dequantized(fp8, tmp_path / "deq"), cfg, "float32")
    assert_same_tree(loaded, reference)
    ours, theirs = _logits(fp8, loaded), _logits(fp8, reference)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    original = _logits(src, convert_checkpoint(src, cfg, "float32"))
    error = np.abs(ours - original)
    assert 0 < error.mean() <= MEAN_LOGIT_ERROR_VS_BF16 and error.max() <= MAX_LOGIT_ERROR_VS_BF16, error.max()


def test_modules_the_release_leaves_in_bf16_load_unchanged(tmp_path):
    src, fp8 = _export(tmp_path, "qwen3_5_moe_vlm")
    cfg = ModelConfig.from_pretrained(fp8)
    listed = json.loads((fp8 / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in listed and "model.visual" in listed
    raw = read_tensors(fp8)
    assert raw["model.language_model.layers.0.linear_attn.in_proj_b.weight"].dtype.name == "bfloat16"
    assert raw["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].dtype.name == "float8_e4m3fn"
    q, o = convert_checkpoint(fp8, cfg, "bfloat16"), convert_checkpoint(src, cfg, "bfloat16")
    for leaf in ("embed", "lm_head"):
        np.testing.assert_array_equal(q[leaf], o[leaf])
    lin, Hv = (q["layers"][0], o["layers"][0]), cfg.linear_num_value_heads
    np.testing.assert_array_equal(lin[0]["attn"]["in_proj"][-2 * Hv:], lin[1]["attn"]["in_proj"][-2 * Hv:])  # b | a
    assert not np.array_equal(lin[0]["attn"]["in_proj"][:-2 * Hv], lin[1]["attn"]["in_proj"][:-2 * Hv])  # qkv | z
    for leaf in ("conv_weight", "A_log", "dt_bias"):
        np.testing.assert_array_equal(lin[0]["attn"][leaf], lin[1]["attn"][leaf])
    for leaf in ("router", "shared_gate"):
        np.testing.assert_array_equal(lin[0]["mlp"][leaf], lin[1]["mlp"][leaf])


def _rewrite(fp8, edit):
    tensors = read_tensors(fp8)
    edit(tensors)
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})


QKV = "model.layers.0.linear_attn.in_proj_qkv.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(QKV + "_scale_inv"), r"tensor '.*in_proj_qkv.weight'.* is fp8 but has no block scale"),
    (lambda t: t.update({QKV + "_scale_inv": t[QKV + "_scale_inv"][:, :1]}),
     r"'.*in_proj_qkv.weight'.* block scale '.*in_proj_qkv.weight_scale_inv' needs shape \(3, 2\), got \(3, 1\)"),
    # a decay gate the release keeps in bf16, stored as fp8 (the peers' mismatched-exclusion bug)
    (lambda t: t.update({"model.layers.0.linear_attn.in_proj_a.weight":
                         t["model.layers.0.linear_attn.in_proj_a.weight"].astype(t[QKV].dtype)}),
     r"'.*in_proj_a.weight'.* is F8_E4M3, but .*modules_to_not_convert lists its module"),
])
def test_malformed_fp8_checkpoints_name_the_tensor(tmp_path, edit, message):
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "bf16", "qwen3_5", dtype="bfloat16")
    fp8 = export_fp8(src, tmp_path / "fp8", block_size=(48, 48))
    _rewrite(fp8, edit)
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(fp8, ModelConfig.from_pretrained(fp8), "float32")


def _set_scale(value):
    def edit(tensors):
        scale = tensors[QKV + "_scale_inv"].copy()
        scale[1, 0] = value
        tensors[QKV + "_scale_inv"] = scale
    return edit


@pytest.mark.parametrize("value", [np.nan, 0.0, -0.5, np.inf])
def test_fp8_block_scales_that_are_not_finite_and_positive_are_refused(tmp_path, value):
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "bf16", "qwen3_5", dtype="bfloat16")
    fp8 = export_fp8(src, tmp_path / "fp8", block_size=(48, 48))
    _rewrite(fp8, _set_scale(value))
    with pytest.raises(CheckpointError, match=r"block scale '.*in_proj_qkv.weight_scale_inv' in .* of fp8 tensor "
                                              r"'.*in_proj_qkv.weight' has 1 of 6 values that are not finite and "
                                              rf"positive \(e.g. {value} at block \[1, 0\]\)"):
        convert_checkpoint(fp8, ModelConfig.from_pretrained(fp8), "float32")


def test_fp8_tensor_without_quantization_config_is_an_error(tmp_path):
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    fp8 = export_fp8(write_tiny_checkpoint(tmp_path / "bf16", "qwen3_5"), tmp_path / "fp8", block_size=(48, 48))
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.linear_attn.in_proj_qkv.weight'.* is F8_E4M3, but "
                                              "config.json has no quantization_config"):
        convert_checkpoint(fp8, ModelConfig.from_pretrained(fp8), "float32")


@pytest.mark.parametrize("q, message", [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size None must be two positive ints"),
])
def test_unsupported_quantization_configs_are_refused(q, message):
    with pytest.raises(ValueError, match=message):
        Fp8Scheme.from_hf_config({"quantization_config": q})


def test_ignore_list_matches_both_layouts():
    scheme = Fp8Scheme.from_hf_config({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.language_model.layers.0.linear_attn.in_proj_a", "lm_head"]}})
    assert scheme.is_not_converted("model.layers.0.linear_attn.in_proj_a.weight")
    assert scheme.is_not_converted("model.language_model.layers.0.linear_attn.in_proj_a.weight")
    assert not scheme.is_not_converted("model.layers.0.linear_attn.in_proj_a_extra.weight")
    assert not scheme.is_not_converted("model.layers.10.linear_attn.in_proj_a.weight")
