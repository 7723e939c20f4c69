"""YaRN to 1M positions: the rope tables and attention scaling equal transformers' (bit for bit in the frequencies),
logits equal transformers' past the original length on a tiny model, and positions past the limit are refused."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.model.rope import position_limit, rope_frequencies
from qnext.model.rotary import apply_rotary
from tests.support.hf_reference import SHARED

tf = pytest.importorskip("transformers")

RELEASE_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
RELEASE_ROPE = dict(RELEASE_YARN, rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                    mrope_interleaved=True)


def _release_text_config(rope: dict):
    """A Qwen3.5 text config with the release's attention geometry (head_dim 256, 64 rotary dims) and `rope`."""
    hf_cfg = tf.Qwen3_5TextConfig(**dict(SHARED, head_dim=256, max_position_embeddings=262144),
                                  intermediate_size=96, rope_parameters=dict(rope))
    return hf_cfg, ModelConfig.from_hf_config(dict(hf_cfg.to_dict(), model_type="qwen3_5_text"))


def _our_cos_sin(cfg: ModelConfig, positions: np.ndarray):
    """cos and sin [P, rotary_dim/2] as apply_rotary uses them: rotating unit vector e_i gives cos_i at i and
    sin_i at i + rotary_dim/2."""
    half = cfg.rotary_dim // 2
    x = np.zeros((len(positions), half, cfg.head_dim), np.float32)
    x[:, np.arange(half), np.arange(half)] = 1.0
    out = np.asarray(apply_rotary(jnp.asarray(x), jnp.asarray(positions), cfg))
    return out[:, np.arange(half), np.arange(half)], out[:, np.arange(half), np.arange(half) + half]


@pytest.mark.parametrize("rope", [RELEASE_ROPE, dict(RELEASE_ROPE, rope_type="default")])
def test_rope_tables_match_transformers_up_to_2_pow_20(rope):
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    hf_cfg, cfg = _release_text_config({k: v for k, v in rope.items()
                                        if rope["rope_type"] == "yarn" or k not in RELEASE_YARN})
    hf = Qwen3_5TextRotaryEmbedding(hf_cfg)
    inv_freq, scaling = rope_frequencies(cfg)
    np.testing.assert_array_equal(inv_freq, hf.inv_freq.numpy())  # one ulp is ~0.03 rad at 2^20
    assert scaling == pytest.approx(hf.attention_scaling, rel=1e-12)
    if rope["rope_type"] == "yarn":
        assert scaling == pytest.approx(0.1 * np.log(4.0) + 1.0)
    rng = np.random.default_rng(0)
    positions = np.unique(np.concatenate([rng.integers(0, 2**20, 96), [0, 1, 262143, 262144, 2**20 - 1]]))
    hf_cos, hf_sin = hf(torch.zeros(1), torch.tensor(positions)[None])
    half = cfg.rotary_dim // 2
    ours_cos, ours_sin = _our_cos_sin(cfg, positions)
    np.testing.assert_allclose(ours_cos, hf_cos[0, :, :half].numpy(), rtol=0, atol=5e-7)
    np.testing.assert_allclose(ours_sin, hf_sin[0, :, :half].numpy(), rtol=0, atol=5e-7)


def test_release_yarn_covers_1m_positions_and_refuses_beyond_naming_the_option():
    _, yarn = _release_text_config(RELEASE_ROPE)
    assert position_limit(yarn) == 2**20
    assert EngineConfig(max_model_len=2**20).resolved_max_model_len(yarn) == 2**20
    with pytest.raises(ValueError, match=r"max_model_len 1048577 needs 1048577 positions; the model's RoPE covers "
                                         r"1048576 .*with YaRN.*Lower max_model_len"):
        EngineConfig(max_model_len=2**20 + 1).resolved_max_model_len(yarn)

    _, native = _release_text_config(dict(RELEASE_ROPE, rope_type="default"))
    assert position_limit(native) == 262144
    with pytest.raises(ValueError, match=r"covers 262144 .*\"rope_parameters\": \{\"rope_type\": \"yarn\", "
                                         r"\"factor\": 4.0, \"original_max_position_embeddings\": 262144"):
        EngineConfig(max_model_len=2**20).resolved_max_model_len(native)


def test_yarn_logits_match_transformers_past_the_original_length(tmp_path):
    """A tiny model trained at 64 positions, stretched 4x by YaRN: logits at all 200 positions (most past 64)."""
    import qnext
    from tests.support.hf_reference import build_hf_model, hf_logits, save_hf_model

    for family in ("qwen3_5", "qwen3_next"):
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "factor": 4.0,
                "original_max_position_embeddings": 64}
        hf = build_hf_model(family, seed=5, max_position_embeddings=256, rope=rope)
        model = qnext.load_model(save_hf_model(hf, tmp_path / family))
        assert model.config.rope_scaling.rope_type == "yarn"
        ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 200)
        ours, ref = model.logits(ids), hf_logits(hf, ids)
        assert np.abs(ref).max() > 0.1
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4, err_msg=family)
