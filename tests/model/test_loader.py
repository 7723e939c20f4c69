from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qnext.config import ModelConfig
from qnext.model import converted_params_store
from qnext.model.loader import CheckpointError, convert_checkpoint, load_params
from qnext.model.weights import map_specs, param_specs
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from tests.support.trees import assert_same_tree


def convert(path, dtype="float32"):
    return convert_checkpoint(path, ModelConfig.from_pretrained(path), dtype)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_params_match_specs(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    cfg = ModelConfig.from_pretrained(path)
    params = convert_checkpoint(path, cfg, "bfloat16")
    map_specs(lambda p, s: _check_leaf(params, p, s), param_specs(cfg, "bfloat16"))


def _check_leaf(params, path, spec):
    node = params
    for k in path:
        node = node[k]
    assert node.shape == spec.shape and node.dtype == spec.dtype, path


def test_layouts_against_hf_names(tiny_checkpoint):
    """Qwen3.5 tensors are in conv order already: the in_proj columns and q|gate split follow directly."""
    path = tiny_checkpoint("qwen3_5_moe")
    raw = load_file(str(path / "model.safetensors"))
    p = convert(path)
    lin, full = p["layers"][0], p["layers"][3]
    qkv = raw["model.layers.0.linear_attn.in_proj_qkv.weight"]
    np.testing.assert_array_equal(lin["attn"]["in_proj"][:128], qkv)
    np.testing.assert_array_equal(lin["attn"]["in_proj"][-4:], raw["model.layers.0.linear_attn.in_proj_a.weight"])
    q_proj = raw["model.layers.3.self_attn.q_proj.weight"]  # rows per head: [q (32) | gate (32)]
    np.testing.assert_array_equal(full["attn"]["qkv_proj"][32:64], q_proj[64:96])  # q head 1
    np.testing.assert_array_equal(full["attn"]["qkv_proj"][128:160], q_proj[32:64])  # gate head 0
    gate_e1 = raw["model.layers.0.mlp.experts.1.gate_proj.weight"]
    np.testing.assert_array_equal(lin["mlp"]["experts_gate_up"][1][:, :32], gate_e1.T)
    np.testing.assert_array_equal(p["lm_head"], raw["lm_head.weight"])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_fused_experts_equal_per_expert(tiny_checkpoint, family):
    assert_same_tree(convert(tiny_checkpoint(family)), convert(tiny_checkpoint(family, fused_experts=True)))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_vlm_nested_equals_flat(tiny_checkpoint, family):
    vlm = tiny_checkpoint(family, vlm=True)
    assert json.loads((vlm / "config.json").read_text())["model_type"] == family
    assert_same_tree(convert(tiny_checkpoint(family)), convert(vlm))


def test_sharded_equals_single(tiny_checkpoint):
    sharded = tiny_checkpoint("qwen3_next", num_shards=3)
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    assert_same_tree(convert(tiny_checkpoint("qwen3_next")), convert(sharded))


def test_tied_embeddings(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    p = convert(path)
    np.testing.assert_array_equal(p["lm_head"], p["embed"])


def test_bfloat16_keeps_gdn_decay_in_float32(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_next", dtype="bfloat16")
    p32, p16 = convert(path, "float32"), convert(path, "bfloat16")
    assert p16["embed"].dtype.name == "bfloat16" and p32["embed"].dtype == np.float32
    assert p16["layers"][0]["attn"]["A_log"].dtype == np.float32
    np.testing.assert_array_equal(p32["embed"].astype(p16["embed"].dtype), p16["embed"])


def test_skips_mtp_and_visual_tensors(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5_moe", vlm=True, fused_experts=True)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    assert convert(path)["embed"].shape == (512, 64)


# ---- errors name the tensor and the file ---------------------------------------------------------------------------
def _edit(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))


def test_missing_tensor(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_next")
    _edit(path, lambda t: t.pop("model.layers.0.linear_attn.dt_bias"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.linear_attn\.dt_bias.*missing"):
        convert(path)


def test_unexpected_tensor(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5")
    _edit(path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(3, np.float32)}))
    name = r"'model\.layers\.0\.self_attn\.q_proj\.bias'"
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {name} in model\.safetensors"):
        convert(path)


def test_wrong_shape(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5_moe", fused_experts=True)
    key = "model.layers.2.mlp.experts.gate_up_proj"
    _edit(path, lambda t: t.update({key: t[key][:, :40]}))
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj' in model\.safetensors has shape \(8, 40, 64\)"):
        convert(path)


def test_config_mismatch_is_reported(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    cfg = ModelConfig.from_pretrained(path)
    import dataclasses

    with pytest.raises(CheckpointError, match="in_proj_qkv"):
        convert_checkpoint(path, dataclasses.replace(cfg, linear_key_head_dim=8))


def test_missing_shard(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5", num_shards=2)
    os.remove(path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        convert(path)


def test_no_weights(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5")
    os.remove(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        convert(path)


# ---- converted cache -----------------------------------------------------------------------------------------------
def test_second_load_restores_converted_params(tmp_path, monkeypatch):
    path = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe")
    cfg = ModelConfig.from_pretrained(path)
    first = load_params(path, cfg, "bfloat16", cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 1

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr("qnext.model.loader.convert_checkpoint", no_conversion)
    second = load_params(path, cfg, "bfloat16", cache_dir=tmp_path / "cache")
    assert isinstance(second["layers"], tuple) and second["layers"][0]["attn"]["A_log"].dtype == np.float32
    assert_same_tree(first, second)


def test_cache_key_tracks_files_and_dtype(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5")
    key = converted_params_store.cache_key(path, "float32")
    assert converted_params_store.cache_key(path, "bfloat16") != key
    os.utime(path / "model.safetensors", ns=(1, 1))
    assert converted_params_store.cache_key(path, "float32") != key
