"""Tiny transformers models with every parameter perturbed: the oracle for logits tests."""
from __future__ import annotations

from pathlib import Path

LIN, FULL = "linear_attention", "full_attention"

SHARED = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
              layer_types=[LIN, FULL, LIN, FULL], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def build_hf_model(family: str, seed: int = 0, rope: dict | None = None, **overrides):
    """`rope`: the rope_parameters (default ROPE; Qwen3.5 families add their MRoPE fields)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(SHARED, **overrides)
    rope = dict(rope or ROPE)
    if family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**kw, intermediate_size=96, rope_parameters=rope, mlp_only_layers=[2],
                                 norm_topk_prob=False, **MOE)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif family == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(**kw, intermediate_size=96,
                                   rope_parameters=dict(rope, mrope_section=[2, 1, 1], mrope_interleaved=True))
        model = tf.Qwen3_5ForCausalLM(cfg)
    elif family == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeTextConfig(**kw, rope_parameters=dict(rope, mrope_section=[2, 1, 1],
                                                                 mrope_interleaved=True), **MOE)
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    else:
        raise ValueError(family)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if p.ndim == 1 else 0.08
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def save_hf_model(model, out_dir: Path) -> Path:
    model.save_pretrained(out_dir)
    return out_dir


def hf_logits(model, token_ids):
    """Logits [T, V] as a float32 numpy array."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()
