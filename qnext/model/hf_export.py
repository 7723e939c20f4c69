"""Weights pytree (docs/CONTRACTS.md) -> Hugging Face tensors in the checkpoint's own layout: loader.py inverted.

Qwen3-Next (`model_type` qwen3_next) gets its per-key-head packed `in_proj_qkvz` / `in_proj_ba`; Qwen3.5 its split
`in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`. `q_proj` rows are per head [query h | gate h]. Experts are
written per expert (`experts.N.{gate,up,down}_proj.weight`, what transformers' save_pretrained writes) or fused
(`experts.gate_up_proj` [E, 2I, H] gate rows first, `experts.down_proj` [E, H, I], as Qwen3.5-MoE releases ship);
transformers, vLLM and qnext load both. Every transform only moves entries, so it maps gradients of the params
to gradients of the HF tensors too.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from qnext.config import ModelConfig

TEXT_PREFIX = "model."
VLM_TEXT_PREFIX = "model.language_model."


def to_hf_tensors(params: dict[str, Any], cfg: ModelConfig, *, prefix: str = TEXT_PREFIX,
                  fused_experts: bool = False) -> dict[str, np.ndarray]:
    """params: the weights pytree of `cfg` (numpy or jax arrays). Returns HF name -> numpy array. `prefix` is
    where the decoder's tensors live: "model." (causal LM checkpoints) or "model.language_model." (Qwen3.5 VLM
    checkpoints). No `lm_head.weight` when the embeddings are tied."""
    t = {prefix + "embed_tokens.weight": np.asarray(params["embed"]),
         prefix + "norm.weight": np.asarray(params["final_norm"])}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = np.asarray(params["lm_head"])
    for i, layer in enumerate(params["layers"]):
        p = f"{prefix}layers.{i}."
        t[p + "input_layernorm.weight"] = np.asarray(layer["input_norm"])
        t[p + "post_attention_layernorm.weight"] = np.asarray(layer["post_attn_norm"])
        attn = {k: np.asarray(v) for k, v in layer["attn"].items()}
        if cfg.is_linear_layer(i):
            t.update(_linear_attention(attn, p + "linear_attn.", cfg))
        else:
            t.update(_full_attention(attn, p + "self_attn.", cfg))
        mlp = {k: np.asarray(v) for k, v in layer["mlp"].items()}
        t.update(_moe(mlp, p + "mlp.", cfg, fused_experts) if cfg.is_moe_layer(i) else _dense_mlp(mlp, p + "mlp."))
    return t


def _linear_attention(a: dict[str, np.ndarray], p: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    h = a["in_proj"].shape[1]
    # in_proj rows: q (Hk*dk) | k (Hk*dk) | v (Hv*dv) | z (Hv*dv) | b (Hv) | a (Hv), each head-major
    q, k, v, z, b, a_ = np.split(a["in_proj"], np.cumsum([hk * dk, hk * dk, hv * dv, hv * dv, hv]), axis=0)
    out = {}
    if cfg.model_type == "qwen3_next":
        groups = lambda x: x.reshape(hk, -1, h)  # noqa: E731  head-major rows -> [Hk, rows of key head g's group, H]
        out[p + "in_proj_qkvz.weight"] = np.concatenate([groups(x) for x in (q, k, v, z)], axis=1).reshape(-1, h)
        out[p + "in_proj_ba.weight"] = np.concatenate([groups(b), groups(a_)], axis=1).reshape(-1, h)
    else:
        out[p + "in_proj_qkv.weight"] = np.concatenate([q, k, v])     # the conv channel order already
        out[p + "in_proj_z.weight"], out[p + "in_proj_b.weight"], out[p + "in_proj_a.weight"] = z, b, a_
    out[p + "conv1d.weight"] = a["conv_weight"][:, None, :]          # [conv_dim, 1, K]
    out[p + "A_log"], out[p + "dt_bias"] = a["A_log"], a["dt_bias"]
    out[p + "norm.weight"] = a["norm"]
    out[p + "out_proj.weight"] = a["out_proj"]
    return out


def _full_attention(a: dict[str, np.ndarray], p: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def q_k_v(fused: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # rows q (head-major) | gate (head-major) | k | v -> q_proj rows per head [query h | gate h], k, v
        q, gate, k, v = np.split(fused, np.cumsum([hq * d, hq * d, hkv * d]), axis=0)
        rest = fused.shape[1:]
        q_proj = np.stack([q.reshape(hq, d, *rest), gate.reshape(hq, d, *rest)], axis=1).reshape(2 * hq * d, *rest)
        return q_proj, k, v

    out = dict(zip((p + f"{n}_proj.weight" for n in "qkv"), q_k_v(a["qkv_proj"])))
    out[p + "o_proj.weight"] = a["o_proj"]
    out[p + "q_norm.weight"], out[p + "k_norm.weight"] = a["q_norm"], a["k_norm"]
    if "qkv_bias" in a:
        out.update(zip((p + f"{n}_proj.bias" for n in "qkv"), q_k_v(a["qkv_bias"])))
        out[p + "o_proj.bias"] = a["o_bias"]
    return out


def _dense_mlp(m: dict[str, np.ndarray], p: str) -> dict[str, np.ndarray]:
    gate, up = np.split(m["gate_up"], 2, axis=0)
    return {p + "gate_proj.weight": gate, p + "up_proj.weight": up, p + "down_proj.weight": m["down"]}


def _moe(m: dict[str, np.ndarray], p: str, cfg: ModelConfig, fused: bool) -> dict[str, np.ndarray]:
    gate_up = m["experts_gate_up"].transpose(0, 2, 1)                # [E, H, 2I] -> [E, 2I, H], gate rows first
    down = m["experts_down"].transpose(0, 2, 1)                      # [E, I, H] -> [E, H, I]
    shared_gate, shared_up = np.split(m["shared_gate_up"], 2, axis=0)
    out = {p + "gate.weight": m["router"], p + "shared_expert.gate_proj.weight": shared_gate,
           p + "shared_expert.up_proj.weight": shared_up, p + "shared_expert.down_proj.weight": m["shared_down"],
           p + "shared_expert_gate.weight": m["shared_gate"]}
    if fused:
        out[p + "experts.gate_up_proj"], out[p + "experts.down_proj"] = gate_up, down
        return out
    i = cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        out[f"{p}experts.{e}.gate_proj.weight"] = gate_up[e, :i]
        out[f"{p}experts.{e}.up_proj.weight"] = gate_up[e, i:]
        out[f"{p}experts.{e}.down_proj.weight"] = down[e]
    return out
