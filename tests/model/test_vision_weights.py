"""The tower's weights load from `model.visual.*` (dense and MoE VL layouts, sharded too); a text-only
checkpoint has no tower; wrong tensors are named."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qnext.model.loader import CheckpointError
from qnext.model.vision_weights import PREFIX, has_vision_tower, load_vision_params, to_hf_vision_tensors
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from qnext.tokenizer import Tokenizer
from qnext.vision.config import VisionConfig, vision_configs


def file_tensors(path):
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        out.update(load_file(str(f)))
    return {k: v for k, v in out.items() if k.startswith(PREFIX)}


@pytest.mark.parametrize("family,options", [("qwen3_5", {}), ("qwen3_5_moe", {"fused_experts": True, "num_shards": 3})])
def test_tower_weights_round_trip(tmp_path, family, options):
    path = write_tiny_checkpoint(tmp_path, family, vlm=True, **options)
    cfg, ids = vision_configs(json.loads((path / "config.json").read_text()))
    tokenizer = Tokenizer.from_pretrained(path)
    assert has_vision_tower(path) and (ids.image_token_id, ids.video_token_id, ids.vision_start_token_id,
                                       ids.vision_end_token_id) == tuple(tokenizer.token_to_id(t) for t in (
                                           "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
    params = load_vision_params(path)
    assert params["patch_embed"]["weight"].shape == (cfg.hidden_size, cfg.patch_dim)
    assert len(params["blocks"]) == cfg.depth
    stored = file_tensors(path)
    back = to_hf_vision_tensors(params, cfg)
    assert sorted(back) == sorted(stored)
    for name, value in stored.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_text_only_checkpoint_has_no_tower(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5")
    assert not has_vision_tower(path)
    assert load_vision_params(path) is None


def test_wrong_tower_tensors_are_named(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5", vlm=True)
    tensors = load_file(str(path / "model.safetensors"))
    extra = dict(tensors, **{PREFIX + "blocks.7.norm1.weight": np.ones(32, np.float32)})
    save_file(extra, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="blocks.7.norm1.weight"):
        load_vision_params(path)
    del tensors[PREFIX + "merger.linear_fc2.bias"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="merger.linear_fc2.bias"):
        load_vision_params(path)


def test_vision_config_from_hf():
    assert VisionConfig.from_hf({}) == VisionConfig()          # Qwen3.5's tower: depth 27, hidden 1152, patch 16
    assert VisionConfig.from_hf({"patch_size": [14, 14], "rope_parameters": {"rope_theta": 500.0}}).patch_size == 14
    with pytest.raises(ValueError, match="num_position_embeddings"):
        VisionConfig.from_hf({"num_position_embeddings": 2300})
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_hf({"hidden_act": "relu"})


def test_load_checkpoint_brings_the_tower_when_asked(tiny_checkpoint):
    from qnext.model.checkpoint import load_checkpoint

    vl = tiny_checkpoint("qwen3_5", vlm=True)
    assert load_checkpoint(vl).vision is None                                   # text-only use: not loaded
    tower = load_checkpoint(vl, with_vision=True).vision
    np.testing.assert_array_equal(np.asarray(tower["blocks"][0]["qkv_weight"]),
                                  load_vision_params(vl)["blocks"][0]["qkv_weight"])
    assert load_checkpoint(tiny_checkpoint("qwen3_5"), with_vision=True).vision is None
