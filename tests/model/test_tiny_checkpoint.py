"""Tiny checkpoints are real HF checkpoints, and qnext reads HF-written ones: cross-checked with transformers."""
from __future__ import annotations

import json

import numpy as np
import pytest

from qnext.config import ModelConfig
from qnext.model.loader import convert_checkpoint
from qnext.testing.tiny_checkpoint import demo_checkpoint_dir, write_tiny_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_load(path, cls=None):
    cls = cls or transformers.AutoModelForCausalLM
    model, info = cls.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info.get("mismatched_keys"), info["mismatched_keys"]
    return model.eval()


def assert_matches_hf(model, path):
    """Every converted tensor equals what transformers computes or holds for the same checkpoint."""
    cfg = ModelConfig.from_pretrained(path)
    params = convert_checkpoint(path, cfg, "float32")
    decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
    T, H = 5, cfg.hidden_size
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(0))
    xn = x[0].numpy()

    def close(ours, theirs):
        np.testing.assert_allclose(ours, theirs.detach().reshape(ours.shape).numpy(), rtol=1e-5, atol=1e-5)

    close(params["embed"], decoder.embed_tokens.weight)
    close(params["final_norm"], decoder.norm.weight)
    close(params["lm_head"], model.lm_head.weight)
    for i, layer in enumerate(decoder.layers):
        p = params["layers"][i]
        close(p["input_norm"], layer.input_layernorm.weight)
        close(p["post_attn_norm"], layer.post_attention_layernorm.weight)
        if cfg.is_linear_layer(i):
            la, ours = layer.linear_attn, p["attn"]
            with torch.no_grad():
                if hasattr(la, "in_proj_qkvz"):  # HF de-interleaves per key head at run time
                    q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
                    qkv = torch.cat([t.reshape(1, T, -1) for t in (q, k, v)], dim=-1)
                else:
                    qkv, z, b, a = la.in_proj_qkv(x), la.in_proj_z(x), la.in_proj_b(x), la.in_proj_a(x)
            y = xn @ ours["in_proj"].T
            cuts = np.cumsum([cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads])
            for got, want in zip(np.split(y, cuts, axis=-1), (qkv, z, b, a)):
                close(got, want)
            close(ours["conv_weight"], la.conv1d.weight[:, 0, :])
            close(ours["A_log"], la.A_log)
            close(ours["dt_bias"], la.dt_bias)
            close(ours["norm"], la.norm.weight)
            close(ours["out_proj"], la.out_proj.weight)
        else:
            sa, ours = layer.self_attn, p["attn"]
            Hq, D = cfg.num_attention_heads, cfg.head_dim
            with torch.no_grad():  # HF: q_proj viewed as [T, Hq, 2D], chunked into query | gate per head
                query, gate = torch.chunk(sa.q_proj(x).view(1, T, Hq, 2 * D), 2, dim=-1)
                want = torch.cat([query.reshape(1, T, -1), gate.reshape(1, T, -1), sa.k_proj(x), sa.v_proj(x)], -1)
            close(xn @ ours["qkv_proj"].T + ours.get("qkv_bias", 0), want)  # HF's Linear adds the bias
            close(ours["o_proj"], sa.o_proj.weight)
            if cfg.attention_bias:
                close(ours["o_bias"], sa.o_proj.bias)
            close(ours["q_norm"], sa.q_norm.weight)
            close(ours["k_norm"], sa.k_norm.weight)
        mlp, ours = layer.mlp, p["mlp"]
        if cfg.is_moe_layer(i):
            close(ours["router"], mlp.gate.weight)
            close(ours["experts_gate_up"], mlp.experts.gate_up_proj.transpose(1, 2))
            close(ours["experts_down"], mlp.experts.down_proj.transpose(1, 2))
            se = mlp.shared_expert
            close(ours["shared_gate_up"], torch.cat([se.gate_proj.weight, se.up_proj.weight]))
            close(ours["shared_down"], se.down_proj.weight)
            close(ours["shared_gate"], mlp.shared_expert_gate.weight)
        else:
            close(ours["gate_up"], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            close(ours["down"], mlp.down_proj.weight)


@pytest.mark.parametrize("family, kwargs", [
    ("qwen3_next", {}),
    ("qwen3_next", {"attention_bias": True, "dtype": "bfloat16"}),
    ("qwen3_5", {"tie_word_embeddings": True}),
    ("qwen3_5_moe", {}),
    ("qwen3_5_moe", {"fused_experts": True, "num_shards": 2}),
    ("qwen3_5", {"vlm": True}),
    ("qwen3_5_moe", {"vlm": True, "fused_experts": True}),
])
def test_tiny_checkpoint_loads_in_transformers(tiny_checkpoint, family, kwargs):
    path = tiny_checkpoint(family, **kwargs)
    model = hf_load(path)
    assert type(model).__name__ == {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                                    "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[family]
    assert_matches_hf(model, path)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_vlm_checkpoint_loads_as_conditional_generation(tiny_checkpoint, family):
    cls = getattr(transformers, {"qwen3_5": "Qwen3_5ForConditionalGeneration",
                                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}[family])
    hf_load(tiny_checkpoint(family, vlm=True), cls)  # vision tower names and shapes are transformers' own


def _perturbed(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim == 1 else 0.08))
    return model.eval()


def test_reads_checkpoint_saved_by_transformers_qwen3_next(tmp_path):
    """Recipe A Qwen3-Next with a dense layer: the per-key-head qkvz/ba de-interleave matches HF's forward."""
    cfg = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, intermediate_size=96, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    model = _perturbed(transformers.Qwen3NextForCausalLM(cfg))
    model.save_pretrained(tmp_path)
    assert_matches_hf(model, tmp_path)


def test_reads_vlm_checkpoint_saved_by_transformers_qwen3_5_moe(tmp_path):
    text = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    model = _perturbed(transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)))
    model.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).model_type == "qwen3_5_moe"
    assert_matches_hf(model, tmp_path)


def test_written_files(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5", vlm=True)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {f.name for f in path.iterdir()}
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "qwen3_5_text"
    cfg = ModelConfig.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == cfg.vocab_size and tok.eos_token_id in cfg.eos_token_ids


def test_same_seed_same_weights_different_seed_differs(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", "qwen3_next", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", "qwen3_next", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", "qwen3_next", seed=4)
    data = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert data[0] == data[1] != data[2]


def test_demo_checkpoint_built_once(tmp_path):
    path = demo_checkpoint_dir(tmp_path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_checkpoint_dir(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    ModelConfig.from_pretrained(path)
