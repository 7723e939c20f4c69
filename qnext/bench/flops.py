"""FLOPs of the model, counted from its parameter specs (qnext/model/weights.py): every matmul weight a token
goes through is a spec with an "embed" axis (the hidden size in or out), which excludes the embedding lookup and the
conv; an expert stack [E, in, out] counts once per routed expert."""
from __future__ import annotations

from qnext.config import ModelConfig
from qnext.model.weights import ParamSpec, map_specs, param_specs


def matmul_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of every weight matrix a token goes through (routed experts: num_experts_per_tok of each stack),
    lm_head last."""
    shapes: list[tuple[int, int]] = []

    def visit(path: tuple, spec: ParamSpec) -> None:
        if path[0] in ("embed", "lm_head") or "embed" not in spec.axes or len(spec.shape) < 2:
            return
        if spec.axes[0] == "expert":                       # [E, in, out]
            shapes.extend([(spec.shape[1], spec.shape[2])] * cfg.num_experts_per_tok)
        else:                                              # [out, in]
            shapes.append((spec.shape[1], spec.shape[0]))

    specs = param_specs(cfg)
    map_specs(visit, specs)
    return shapes + [(cfg.hidden_size, cfg.vocab_size)]


def token_flops(cfg: ModelConfig, context: float, sampled: bool) -> dict[str, float]:
    """FLOPs of one token at `context` tokens of history: matmuls (2 per MAC), attention QK^T + PV over the
    context, the delta rule's state terms (decay, S^T k, k delta^T, S^T q: 4 dk dv per value head), conv."""
    body = sum(2 * k * n for k, n in matmul_shapes(cfg)[:-1])
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size if sampled else 0
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * context * len(cfg.full_layer_ids)
    delta = len(cfg.linear_layer_ids) * cfg.linear_num_value_heads * (
        2 * 4 * cfg.linear_key_head_dim * cfg.linear_value_head_dim) + 2 * cfg.conv_dim * cfg.linear_conv_kernel_dim
    return {"matmul": body + lm_head, "attention": attn, "deltanet": delta}


def workload_flops(cfg: ModelConfig, prompt_lens: list[int], output_len: int) -> dict[str, float]:
    """Prefill (every prompt token; lm_head only for the last) and decode (output_len - 1 steps) FLOPs."""
    prefill = decode = 0.0
    for n in prompt_lens:
        body = token_flops(cfg, (n - 1) / 2, False)
        prefill += n * (body["matmul"] + body["attention"] + body["deltanet"]) + 2 * cfg.hidden_size * cfg.vocab_size
        for j in range(1, output_len):
            decode += sum(token_flops(cfg, n + j, True).values())
    return {"prefill": prefill, "decode": decode}
