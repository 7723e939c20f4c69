"""Long-context plan for Qwen3.5-27B and Qwen3.5-397B-A17B at 256k and 1M tokens (docs/scale.md, "Long context"):
KV bytes, snapshot (state row) bytes, and prefill time from the compute roofline. Pure host arithmetic from the
model configs and the engine's cache layout (qnext/model/cache_layout.py); nothing is allocated.

    python scripts/long_context_plan.py
    python scripts/long_context_plan.py --lengths 262144 1048576 --peak-tflops 989 --mfu 0.5

Prefill FLOPs of a T-token prompt (a multiply-add = 2 FLOPs):
- weights: 2 x (active matmul params) per token (the MoE's top-k experts and shared expert, not all experts; the
  embedding is a lookup, the lm_head runs on the last token only);
- attention: per full-attention layer QK^T and PV over the causal half, 2 x 2 x Hq x D x T^2 / 2;
- delta rule (chunked, C = 64): per linear layer and token, about 2 x Hv x (2 C (dk + dv) + 3 dk dv) (the intra-chunk
  C x C products and the state-side products), linear in T.
Time = FLOPs / (devices x peak x mfu); the roofline's compute side (prefill at these lengths is compute-bound: the
weights are read once per chunk of thousands of tokens). The snapshot row is the state a prefix snapshot copies:
fp32 recurrent state plus the conv state in the cache dtype, per linear-attention layer.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache.checkpoint_spacing import checkpoint_positions  # noqa: E402
from qnext.config import ModelConfig  # noqa: E402
from qnext.model.cache_layout import cache_layout  # noqa: E402

GIB = 1 << 30
YARN_1M = {"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "factor": 4.0,
           "original_max_position_embeddings": 262144}
COMMON = {"vocab_size": 248320, "head_dim": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
          "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "max_position_embeddings": 262144,
          "rms_norm_eps": 1e-6, "rope_parameters": YARN_1M, "tie_word_embeddings": False, "eos_token_id": 2}
MODELS = {   # shared/reference qwen-math.md "Known sizes"
    "Qwen3.5-27B": dict(COMMON, model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                        linear_num_value_heads=48, intermediate_size=17408),
    "Qwen3.5-397B-A17B": dict(COMMON, model_type="qwen3_5_moe_text", hidden_size=4096, num_hidden_layers=60,
                              num_attention_heads=32, num_key_value_heads=2, linear_num_key_heads=16,
                              linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=4096),
}
DEVICES = {"Qwen3.5-27B": 1, "Qwen3.5-397B-A17B": 8}     # bf16 weights: 54 GB on one GPU; 794 GB over 8 H200s


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies through (per layer mixer + MLP, lm_head excluded)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (2 * cfg.num_attention_heads * d + 2 * cfg.num_key_value_heads * d) + cfg.num_attention_heads * d * h
    lin = h * (cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads) + cfg.value_dim * h
    if cfg.num_experts:
        mlp = 3 * h * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
        mlp += h * cfg.num_experts                                             # the router
    else:
        mlp = 3 * h * cfg.intermediate_size
    return len(cfg.full_layer_ids) * attn + len(cfg.linear_layer_ids) * lin + cfg.num_hidden_layers * mlp


def prefill_flops(cfg: ModelConfig, t: int, chunk: int = 64) -> dict[str, float]:
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return {"weights": 2.0 * active_matmul_params(cfg) * t,
            "attention": len(cfg.full_layer_ids) * 2.0 * cfg.num_attention_heads * cfg.head_dim * t * t,
            "delta_rule": len(cfg.linear_layer_ids) * 2.0 * hv * (2 * chunk * (dk + dv) + 3 * dk * dv) * t}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[262144, 1048576])
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 per device (H100/H200 SXM: 989)")
    p.add_argument("--mfu", type=float, default=0.5, help="share of the peak the prefill kernels reach")
    args = p.parse_args(argv)
    print(f"{'model':<18} {'tokens':>8} {'KV GiB':>7} {'row MiB':>8} {'rows':>4} {'snap GiB':>8} "
          f"{'PFLOP w/attn/dr':>19} {'attn %':>6} {'devs':>4} {'prefill s':>9} {'CP x4 s':>8}")
    for name, raw in MODELS.items():
        cfg = ModelConfig.from_hf_config(raw)
        layout = cache_layout(cfg, "bfloat16")
        kv_per_token = layout.kv_bytes_per_block(1)
        row = layout.state_bytes_per_row
        for t in args.lengths:
            # a session's snapshots: the prompt's checkpoints, its last boundary, two turn starts, the finished end
            rows = len(checkpoint_positions(t, 1024)) + 4          # the default 1k interval
            f = prefill_flops(cfg, t)
            total = sum(f.values())
            devs = DEVICES[name]
            rate = devs * args.peak_tflops * 1e12 * args.mfu
            seconds = total / rate
            # context parallelism over 4 more groups of `devs` devices: every part splits 4 ways (attention by
            # query shards over the gathered KV, the delta rule by the affine split); the exchange is not counted
            cp = total / (4 * rate)
            print(f"{name:<18} {t:>8} {kv_per_token * t / GIB:>7.1f} {row / (1 << 20):>8.1f} {rows:>4} "
                  f"{rows * row / GIB:>8.2f} {f['weights'] / 1e15:>6.1f}/{f['attention'] / 1e15:>5.1f}/"
                  f"{f['delta_rule'] / 1e15:>5.2f} {100 * f['attention'] / total:>6.0f} {devs:>4} {seconds:>9.0f} "
                  f"{cp:>8.0f}")


if __name__ == "__main__":
    main()
