"""3-D positions: interleaved MRoPE with equal axes is today's rope (text costs nothing new), the frequency split
is Qwen3.5's, text after an image continues past the image's largest position, and mismatched prompts are errors
(positions against transformers: tests/model/test_vision_vs_transformers.py)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from qnext.config import ModelConfig
from qnext.model.rotary import apply_rotary
from qnext.testing.tiny_checkpoint import tiny_hf_config
from qnext.vision.mrope import (mrope_axis_of_frequency, mrope_positions, position_delta, text_positions)

IMAGE, VIDEO = 900, 901


def qwen35_rope_config() -> ModelConfig:
    """Qwen3.5's attention geometry: head_dim 256, rotary 64 (32 frequencies), theta 1e7, section [11, 11, 10]."""
    hf = tiny_hf_config("qwen3_5", head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True})
    return ModelConfig.from_hf_config(hf)


def test_equal_axes_are_the_plain_rope():
    cfg = qwen35_rope_config()
    assert cfg.mrope_section == (11, 11, 10)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 4, 256)), jnp.float32)
    positions = jnp.asarray([[0, 1, 2, 3, 50, 51, 52, 4000, 262000]] * 2, jnp.int32)          # [B, T]
    plain = apply_rotary(x, positions, cfg)
    three = apply_rotary(x, jnp.broadcast_to(positions, (3,) + positions.shape), cfg)       # [3, B, T]
    np.testing.assert_array_equal(np.asarray(three), np.asarray(plain))
    moved = apply_rotary(x, jnp.stack([positions, positions + 1, positions]), cfg)          # h differs
    assert np.abs(np.asarray(moved) - np.asarray(plain)).max() > 1e-3


def test_frequency_split_is_interleaved_as_qwen35():
    axis = mrope_axis_of_frequency(32, (11, 11, 10))
    j = np.arange(32)
    np.testing.assert_array_equal(np.flatnonzero(axis == 1), j[(j % 3 == 1) & (j < 33)])
    np.testing.assert_array_equal(np.flatnonzero(axis == 2), j[(j % 3 == 2) & (j < 30)])
    assert (axis == 0).sum() == 32 - 11 - 10


def test_text_after_an_image_continues_past_its_largest_position():
    # 3 text tokens, an image of 4 x 6 patches (merge 2: 2 x 3 tokens), 2 text tokens
    tokens = [1, 2, 3] + [IMAGE] * 6 + [4, 5]
    pos = mrope_positions(tokens, [(1, 4, 6)], IMAGE, VIDEO, spatial_merge_size=2)
    np.testing.assert_array_equal(pos[:, :3], [[0, 1, 2]] * 3)
    np.testing.assert_array_equal(pos[0, 3:9], [3] * 6)                       # t
    np.testing.assert_array_equal(pos[1, 3:9], [3, 3, 3, 4, 4, 4])            # h: rows
    np.testing.assert_array_equal(pos[2, 3:9], [3, 4, 5, 3, 4, 5])            # w: columns
    np.testing.assert_array_equal(pos[:, 9:], [[6, 7]] * 3)                   # 3 + max(2, 3)
    delta = position_delta(pos)
    assert delta == 8 - 11
    # decode continues at token index + delta: what the whole sequence's positions say
    longer = mrope_positions(tokens + [6, 7, 8], [(1, 4, 6)], IMAGE, VIDEO, 2)
    np.testing.assert_array_equal(longer[:, 11:], text_positions(11, 3, delta))


def test_each_video_frame_group_is_its_own_run():
    tokens = [1] + [VIDEO] * 2 + [2] + [VIDEO] * 2 + [3]                      # grid (2, 2, 4): 2 frame groups
    pos = mrope_positions(tokens, [(2, 2, 4)], IMAGE, VIDEO, 2)
    np.testing.assert_array_equal(pos[0], [0, 1, 1, 3, 4, 4, 6])
    np.testing.assert_array_equal(pos[2], [0, 1, 2, 3, 4, 5, 6])


def test_prompts_that_do_not_match_their_inputs_are_errors():
    with pytest.raises(ValueError, match="does not match its grid"):
        mrope_positions([1] + [IMAGE] * 5, [(1, 4, 6)], IMAGE, VIDEO, 2)
    with pytest.raises(ValueError, match="more image / video pad runs"):
        mrope_positions([IMAGE] * 6 + [1] + [IMAGE] * 6, [(1, 4, 6)], IMAGE, VIDEO, 2)
    with pytest.raises(ValueError, match="2 images and video frame groups"):
        mrope_positions([1] + [VIDEO] * 2 + [2], [(2, 2, 4)], IMAGE, VIDEO, 2)


def test_qwen3_next_has_no_mrope_and_text_configs_keep_their_fields():
    assert ModelConfig.from_hf_config(tiny_hf_config("qwen3_next")).mrope_section == ()
    hf = tiny_hf_config("qwen3_5")
    assert ModelConfig.from_hf_config(hf).mrope_section == (2, 1, 1)
    del hf["rope_parameters"]["mrope_section"]
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.mrope_section == (11, 11, 10)                                  # transformers' default
    assert dataclasses.replace(cfg, mrope_section=(2, 1, 1)) != cfg

