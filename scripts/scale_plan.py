"""The flagship's memory plan on 8 devices and the bytes a step moves between them (docs/scale.md), derived from the
model config, the engine's partition rules (qnext/model/tensor_parallel.py) and its cache sizing (cache_sizes ->
cache/sizing.py's plan_cache). Pure host arithmetic: nothing is allocated or compiled.

    python scripts/scale_plan.py                       # Qwen3.5-397B-A17B, 8 x H200, bf16
    python scripts/scale_plan.py --devices 8 --device-gib 140 --activation-gib 4 --max-num-seqs 256
    python scripts/scale_plan.py --device-gib 80 --weights fp8 --kv-cache-dtype fp8   # 8 x H100 80 GB, FP8 release

FP8 weights count as the release stores them (qnext/model/fp8_blocks.py): e4m3 linear weights (1 byte) plus a
float32 scale per 128 x 128 block, the release's ignore list (embeddings, lm_head, router, shared-expert gate, conv1d,
the decay-gate rows b / a of in_proj, norms, A_log, dt_bias) in bf16.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache.sizing import GIB  # noqa: E402
from qnext.config import ModelConfig  # noqa: E402
from qnext.engine.cache_setup import cache_sizes  # noqa: E402
from qnext.engine.config import EngineConfig  # noqa: E402
from qnext.model.cache_layout import cache_layout  # noqa: E402
from qnext.model.tensor_parallel import _split_axis, parallel_config, sharded_model_config  # noqa: E402
from qnext.model.weights import as_dtype, map_specs, param_specs  # noqa: E402

# Qwen3.5-397B-A17B (shared/reference: H 4096, 60 layers, 32/2 heads of 256, DeltaNet 16/64 heads of 128,
# 512 experts top-10 of width 1024, shared expert 4096, vocab 248320); every 4th layer full attention
FLAGSHIP = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60,
    "full_attention_interval": 4, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 4096, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                              "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "eos_token_id": 2,
}


_FP8_LEAVES = ("in_proj", "out_proj", "qkv_proj", "o_proj", "gate_up", "down", "experts_gate_up", "experts_down",
               "shared_gate_up", "shared_down")


def _fp8_bytes(cfg: ModelConfig, path, spec) -> int:
    """A leaf's bytes as the FP8 release stores it: e4m3 + a float32 scale per 128 x 128 block (whole tensors)."""
    import numpy as np

    n = int(np.prod(spec.shape))
    if path[-1] not in _FP8_LEAVES:
        return 2 * n
    bf16_rows = 0
    if path[-1] == "in_proj":                   # the decay-gate rows b | a stay bf16 (a kept weight's tail)
        bf16_rows = 2 * cfg.linear_num_value_heads
    rows, cols = spec.shape[-2:]
    lead = n // (rows * cols)
    fp8_rows = rows - bf16_rows
    blocks = lead * -(-fp8_rows // 128) * -(-cols // 128)
    return lead * (fp8_rows * cols + 2 * bf16_rows * cols) + 4 * blocks


def weight_bytes_per_device(cfg: ModelConfig, tp: int, dtype, weights: str = "bf16") -> dict[str, int]:
    """Bytes one device holds, by part: split params count 1/tp, replicated ones whole. weights "fp8": as the FP8
    release stores them, as fp8_weights="keep" holds them on the device (qnext/model/fp8_keep.py)."""
    sharded = sharded_model_config(cfg, tp)
    parts: dict[str, int] = {}

    def count(path, spec):
        size = (_fp8_bytes(sharded, path, spec) if weights == "fp8"
                else int(spec.dtype.itemsize) * int(__import__("numpy").prod(spec.shape)))
        held = size // tp if tp > 1 and _split_axis(spec, sharded) is not None else size
        part = ("experts" if "experts_" in str(path[-1]) else "shared expert / router" if path[0] == "layers"
                and path[2] == "mlp" else "attention / DeltaNet" if path[0] == "layers" else "embed / lm_head / norms")
        parts[part] = parts.get(part, 0) + held

    map_specs(count, param_specs(sharded, dtype))
    return parts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--device-gib", type=float, default=140.0, help="memory of one device (H200: ~140 GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--activation-gib", type=float, default=4.0,
                   help="the largest step's activations (on a GPU the engine measures them: XLA memory analysis)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-snapshots", type=int, default=None)
    p.add_argument("--weights", default="bf16", choices=["bf16", "fp8"], help="the checkpoint's weight format")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine option (auto: bf16; fp8: e4m3)")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto", help="the engine option (stored snapshots)")
    args = p.parse_args(argv)
    tp, dtype = args.devices, as_dtype("bfloat16")
    base = ModelConfig.from_hf_config(FLAGSHIP)
    print(f"# {base.num_hidden_layers} layers: {len(base.full_layer_ids)} full attention, "
          f"{len(base.linear_layer_ids)} DeltaNet; {tp} devices of {args.device_gib} GiB, {args.weights} weights, "
          f"kv_cache_dtype {args.kv_cache_dtype}, mamba_ssm_cache_dtype {args.mamba_ssm_cache_dtype}\n")
    for expert_parallel in (False, True):
        cfg = parallel_config(base, tp, expert_parallel)
        parts = weight_bytes_per_device(cfg, tp, dtype, args.weights)
        weights = sum(parts.values())
        budget = int(args.gpu_memory_utilization * args.device_gib * GIB) - weights - int(args.activation_gib * GIB)
        config = EngineConfig(tensor_parallel_size=tp, enable_expert_parallel=expert_parallel, dtype="bfloat16",
                              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              max_num_batched_tokens=max(8192, args.max_num_seqs),
                              kv_cache_memory_bytes=budget, max_num_snapshots=args.max_num_snapshots,
                              kv_cache_dtype=args.kv_cache_dtype, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
        sizes = cache_sizes(cfg, config, args.max_model_len)
        layout = cache_layout(sharded_model_config(cfg, tp), dtype, 0, args.kv_cache_dtype, args.mamba_ssm_cache_dtype)
        print(f"## {'EP' if expert_parallel else 'TP'}{tp}: weights {weights / GIB:.2f} GiB per device "
              + ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items()))
        print(f"cache budget {budget / GIB:.2f} GiB = {args.gpu_memory_utilization} x {args.device_gib} - weights - "
              f"{args.activation_gib} activations")
        print(f"KV block ({config.block_size} tokens) {layout.kv_bytes_per_block(config.block_size) // tp} bytes "
              f"per device; state row {layout.state_bytes_per_row // tp} bytes per device"
              + (f", snapshot row {sizes.snapshot_row_bytes} ({args.mamba_ssm_cache_dtype} recurrent state)"
                 if sizes.snapshot_row_bytes else ""))
        print(sizes.describe() + "\n")

    h, layers = base.hidden_size, base.num_hidden_layers
    print("## bytes a step moves per device, per layer (ring all-reduce: 2 (n-1)/n of the payload)")
    print("| batch T | as built (TP, or EP with TP attention): 2 all-reduces of [T, H] f32 | DP attention + EP "
          "all-to-all: dispatch and combine of T/n x k bf16 copies | whole step as built (+ logits all-gather) |")
    print("|---|---|---|---|")
    for t in (1, 64, 256):
        reduce_bytes = 2 * (2 * (tp - 1) / tp) * t * h * 4
        a2a = 2 * max(t / tp, 1) * base.num_experts_per_tok * h * 2 * (tp - 1) / tp
        logits = t * base.vocab_size * 4 * (tp - 1) / tp                     # the vocab all-gather, once a step
        print(f"| {t} | {reduce_bytes / 2**20:.3f} MiB | {a2a / 2**20:.3f} MiB | "
              f"{(layers * reduce_bytes + logits) / 2**20:.1f} MiB |")

if __name__ == "__main__":
    main()
