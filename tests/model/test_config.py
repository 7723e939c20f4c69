from __future__ import annotations

import json

import numpy as np
import pytest

from qnext.config import ModelConfig, RopeScaling
from qnext.model.rope import rope_frequencies
from qnext.model.weights import init_params, map_specs, param_specs
from qnext.testing.tiny_checkpoint import tiny_hf_config

LIN, FULL = "linear_attention", "full_attention"


def nested(family: str, **text_overrides) -> dict:
    text = tiny_hf_config(family, **text_overrides)
    text.pop("architectures")
    return {"model_type": family, "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}


def test_qwen3_next_fields_and_layer_rules():
    cfg = ModelConfig.from_hf_config(tiny_hf_config("qwen3_next", num_hidden_layers=8, layer_types=None,
                                                    mlp_only_layers=[0], decoder_sparse_step=2))
    assert cfg.model_type == "qwen3_next"
    assert cfg.layer_types == (LIN, LIN, LIN, FULL) * 2  # derived from full_attention_interval 4
    assert cfg.full_layer_ids == (3, 7) and cfg.linear_layer_ids == (0, 1, 2, 4, 5, 6)
    assert [cfg.is_moe_layer(i) for i in range(8)] == [False, True, False, True, False, True, False, True]
    assert cfg.norm_topk_prob is False and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert (cfg.key_dim, cfg.value_dim, cfg.conv_dim, cfg.rotary_dim) == (32, 64, 128, 8)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) and cfg.pad_token_id == 0
    hash(cfg)  # static under jit


def test_full_attention_interval():
    c = tiny_hf_config("qwen3_5", num_hidden_layers=6, layer_types=None, full_attention_interval=3)
    assert ModelConfig.from_hf_config(c).layer_types == (LIN, LIN, FULL, LIN, LIN, FULL)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_text"])
def test_qwen3_5_dense(model_type):
    c = nested("qwen3_5") if model_type == "qwen3_5" else tiny_hf_config("qwen3_5")
    cfg = ModelConfig.from_hf_config(c)
    assert cfg.model_type == model_type
    assert cfg.num_experts == 0 and not any(cfg.is_moe_layer(i) for i in range(4))
    assert cfg.intermediate_size == 96 and cfg.partial_rotary_factor == 0.25


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_qwen3_5_moe_every_layer_moe_and_renormalised(model_type):
    # Qwen3.5-MoE has no decoder_sparse_step / mlp_only_layers / norm_topk_prob: a stray value is ignored.
    extra = dict(mlp_only_layers=[1], decoder_sparse_step=2, norm_topk_prob=False)
    c = nested("qwen3_5_moe", **extra) if model_type == "qwen3_5_moe" else tiny_hf_config("qwen3_5_moe", **extra)
    cfg = ModelConfig.from_hf_config(c)
    assert cfg.model_type == model_type
    assert all(cfg.is_moe_layer(i) for i in range(4)) and cfg.norm_topk_prob is True


def test_nested_config_takes_top_level_tie_and_token_ids():
    c = nested("qwen3_5")
    for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        del c["text_config"][k]
    c.update(tie_word_embeddings=True, eos_token_id=[7, 8], bos_token_id=3)
    cfg = ModelConfig.from_hf_config(c)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (7, 8) and cfg.bos_token_id == 3


def test_legacy_top_level_rope_fields():
    c = tiny_hf_config("qwen3_next", rope_theta=5e6, partial_rotary_factor=0.5, rope_scaling=None)
    del c["rope_parameters"]
    cfg = ModelConfig.from_hf_config(c)
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rope_scaling, cfg.rotary_dim) == (5e6, 0.5, None, 16)


def test_legacy_rope_scaling_yarn():
    c = tiny_hf_config("qwen3_next", rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 128})
    del c["rope_parameters"]
    cfg = ModelConfig.from_hf_config(c)
    assert cfg.rope_theta == 1e6
    assert cfg.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=128)


def test_yarn_in_rope_parameters_defaults_original_length():
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "partial_rotary_factor": 0.25, "factor": 2.0}
    cfg = ModelConfig.from_hf_config(tiny_hf_config("qwen3_5", rope_parameters=rope))
    assert cfg.rope_scaling.original_max_position_embeddings == 512


def test_from_pretrained_reads_generation_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen3_5")))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (2, 9)


@pytest.mark.parametrize("change, field", [
    (dict(model_type="llama"), "model_type"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(head_dim=None), "head_dim"),
    (dict(num_experts=None), "num_experts"),
    (dict(intermediate_size=None), "intermediate_size"),  # layer 1 is dense
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(linear_num_key_heads=3), "linear_num_key_heads"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(layer_types=[LIN, FULL]), "layer_types"),
    (dict(layer_types=[LIN, LIN, "sliding_attention", FULL]), "layer_types"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     "partial_rotary_factor"),  # 3.2 rotary dims
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "linear"}), "factor"),
    (dict(vocab_size="512"), "vocab_size"),
    (dict(mlp_only_layers=[4]), "mlp_only_layers"),
])
def test_invalid_configs_name_the_field(change, field):
    c = tiny_hf_config("qwen3_next")
    c.update(change)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(c)


def test_nested_without_text_config():
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_config({"model_type": "qwen3_5_moe"})


def test_no_full_attention_layer_is_allowed():
    cfg = ModelConfig.from_hf_config(tiny_hf_config("qwen3_5", layer_types=[LIN] * 4))
    assert cfg.full_layer_ids == ()


def test_malformed_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "missing")


# ---- RoPE against transformers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5},
    {"rope_type": "linear", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "rope_theta": 1e4, "partial_rotary_factor": 1.0, "factor": 8.0, "beta_fast": 16,
     "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e4, "partial_rotary_factor": 0.25, "factor": 2.0, "attention_factor": 1.3,
     "truncate": False},
])
def test_rope_frequencies_match_transformers(rope):
    tf = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_dict = tiny_hf_config("qwen3_next", rope_parameters=dict(rope))
    hf_cfg = tf.Qwen3NextConfig(**{k: v for k, v in hf_dict.items() if k not in ("architectures", "model_type")})
    if rope["rope_type"] == "default":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

        expect, expect_scale = Qwen3NextRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        expect, expect_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    inv_freq, scale = rope_frequencies(ModelConfig.from_hf_config(hf_dict))
    assert inv_freq.dtype == np.float32 and inv_freq.shape == tuple(expect.shape)
    np.testing.assert_allclose(inv_freq, expect.numpy(), rtol=2e-7, atol=0)
    assert scale == pytest.approx(expect_scale, rel=1e-12)


# ---- weights pytree ------------------------------------------------------------------------------------------------
def test_param_specs_follow_the_contract():
    cfg = ModelConfig.from_hf_config(tiny_hf_config("qwen3_next", attention_bias=True))
    specs = param_specs(cfg, "bfloat16")
    lin, full = specs["layers"][0], specs["layers"][3]
    assert specs["embed"].shape == (512, 64) and specs["lm_head"].shape == (512, 64)
    assert lin["attn"]["in_proj"].shape == (128 + 64 + 8, 64)
    assert lin["attn"]["A_log"].dtype == np.float32 and lin["attn"]["in_proj"].dtype.name == "bfloat16"
    assert full["attn"]["qkv_proj"].shape == (2 * 4 * 32 + 2 * 2 * 32, 64)
    assert set(full["attn"]) == {"qkv_proj", "qkv_bias", "o_proj", "o_bias", "q_norm", "k_norm"}
    assert specs["layers"][1]["mlp"]["gate_up"].shape == (192, 64)  # mlp_only_layers=[1]
    assert specs["layers"][0]["mlp"]["experts_gate_up"].axes == ("expert", "embed", "mlp")
    params = init_params(cfg, "float32", seed=0)
    assert params["layers"][0]["attn"]["conv_weight"].shape == (128, 4)
    assert np.all(params["layers"][0]["attn"]["A_log"] > 0)


QWEN3_NEXT_80B = {  # legacy layout: top-level rope fields, rope_scaling null, layer_types from the interval
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}


def _num_params(cfg):
    sizes = []
    map_specs(lambda _, s: sizes.append(int(np.prod(s.shape))), param_specs(cfg, "bfloat16"))
    return sum(sizes)


def test_release_configs_parse_to_their_sizes():
    cfg = ModelConfig.from_hf_config(QWEN3_NEXT_80B)
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None and len(cfg.full_layer_ids) == 12
    assert all(cfg.is_moe_layer(i) for i in range(48)) and cfg.conv_dim == 8192
    assert 79.0e9 < _num_params(cfg) < 81.5e9

    text = dict(QWEN3_NEXT_80B, model_type="qwen3_5_moe_text", num_hidden_layers=40, num_experts=256,
                num_experts_per_tok=8, vocab_size=248320, attn_output_gate=True, mamba_ssm_dtype="float32",
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    for k in ("rope_theta", "partial_rotary_factor", "rope_scaling", "intermediate_size", "norm_topk_prob",
              "mlp_only_layers", "decoder_sparse_step"):
        del text[k]
    cfg = ModelConfig.from_hf_config({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {},
                                      "tie_word_embeddings": False})
    assert cfg.model_type == "qwen3_5_moe" and cfg.rotary_dim == 64 and cfg.norm_topk_prob
    assert 33.5e9 < _num_params(cfg) < 35.5e9  # 35B-A3B less its vision tower and MTP head
