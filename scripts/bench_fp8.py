"""FP8 measurements (docs/fp8.md): cache capacity at a fixed byte budget, logprob error of the FP8 KV cache, and
bf16 vs FP8 weights on this CPU.

    python scripts/bench_fp8.py                      # all three parts, tiny and small presets
    python scripts/bench_fp8.py --parts capacity     # the arithmetic only (instant)

capacity: KV tokens the engine's cache split (cache_setup.cache_sizes -> cache/sizing.plan_cache) gives at one byte
budget with `kv_cache_dtype` auto vs fp8, at max_model_len 4k and 32k, for the small preset and the flagship
(per device of TP8). logprob: a full-width engine generates N greedy tokens; the prompt + output is scored through
the engine's step with full-width and with fp8 KV pages (every position reads its whole prefix from the pages);
the generated tokens' logprobs are compared (max and mean absolute difference, argmax agreement). weights: the small
preset in bf16 and its FP8 export (qnext/testing/fp8_export.py), each loaded as bfloat16, the export both
dequantised at load (the CPU's default) and kept in e4m3 (fp8_weights="keep", the GPU's default; on CPU it widens
every weight on every step, so it is slower there: it is measured for its device bytes).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 1 << 30


def capacity_rows() -> list[dict]:
    from qnext.bench.presets import PRESETS
    from qnext.config import ModelConfig
    from qnext.engine.cache_setup import cache_sizes
    from qnext.engine.config import EngineConfig
    from qnext.model.tensor_parallel import parallel_config
    from qnext.testing.tiny_checkpoint import tiny_hf_config
    from scripts.scale_plan import FLAGSHIP

    preset = PRESETS["small"]
    small = ModelConfig.from_hf_config(tiny_hf_config(preset.family, **preset.overrides))
    models = {"small (1 GiB budget)": (small, 1, GIB),
              "397B-A17B TP8 (27.28 GiB per device)": (parallel_config(ModelConfig.from_hf_config(FLAGSHIP), 8),
                                                       8, int(27.28 * GIB))}
    rows = []
    for name, (cfg, tp, budget) in models.items():
        for length in (4096, 32768):
            tokens = {}
            for kv in ("auto", "fp8"):
                config = EngineConfig(dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=256 if tp > 1 else 16,
                                      max_model_len=length, kv_cache_memory_bytes=budget, kv_cache_dtype=kv,
                                      mamba_ssm_cache_dtype="bfloat16")
                sizes = cache_sizes(cfg, config, length)
                tokens[kv] = (sizes.num_blocks * sizes.block_size, sizes.num_snapshot_rows)
            rows.append({"model": name, "max_model_len": length, "bf16_tokens": tokens["auto"][0],
                         "fp8_tokens": tokens["fp8"][0], "ratio": tokens["fp8"][0] / tokens["auto"][0],
                         "snapshot_rows": tokens["auto"][1]})
    return rows


def logprob_error(path: Path, num_tokens: int, prompt_len: int = 64) -> dict:
    import qnext
    from qnext import SamplingParams
    from qnext.model.scoring import load_model

    rng = np.random.default_rng(0)
    model = load_model(path, "bfloat16")
    prompt = rng.integers(3, model.config.vocab_size - 8, prompt_len).tolist()
    llm = qnext.LLM(path, dtype="bfloat16", max_model_len=prompt_len + num_tokens + 16, max_num_seqs=1,
                    enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=num_tokens,
                                                                     ignore_eos=True))[0].outputs[0].token_ids
    llm.close()
    ids = prompt + list(out)
    positions = np.arange(prompt_len - 1, len(ids) - 1)          # the logits that predicted each generated token

    def logprobs(kv):
        model.kv_cache_dtype = kv
        logits = model.logits(ids)[positions].astype(np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        lp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        return lp[np.arange(len(positions)), np.asarray(out)], logits.argmax(-1)

    full, full_argmax = logprobs("auto")
    fp8, fp8_argmax = logprobs("fp8")
    err = np.abs(fp8 - full)
    return {"tokens": len(out), "max_abs": float(err.max()), "mean_abs": float(err.mean()),
            "argmax_agreement": float(np.mean(full_argmax == fp8_argmax))}


def weights_rows(root: Path, decode_tokens: int = 32, batch: int = 4) -> list[dict]:
    import jax

    import qnext
    from qnext import SamplingParams
    from qnext.bench.presets import PRESETS
    from qnext.model.checkpoint import load_checkpoint
    from qnext.testing.fp8_export import export_fp8
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    preset = PRESETS["small"]
    bf16 = root / "small-bf16"
    if not (bf16 / "config.json").exists():
        write_tiny_checkpoint(bf16, preset.family, seed=0, dtype="bfloat16", **preset.overrides)
    fp8 = root / "small-fp8"
    if not (fp8 / "config.json").exists():
        export_fp8(bf16, fp8)
    rows = []
    for name, path, mode in (("bf16", bf16, "dequantize"), ("fp8, dequantize", fp8, "dequantize"),
                             ("fp8, keep", fp8, "keep")):
        start = time.perf_counter()
        params = jax.block_until_ready(load_checkpoint(path, "bfloat16", fp8_weights=mode).params)
        load_s = time.perf_counter() - start
        device_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        del params
        llm = qnext.LLM(path, dtype="bfloat16", max_num_seqs=batch, max_model_len=256, fp8_weights=mode)
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(3, 8000, 32).tolist()} for _ in range(batch)]
        greedy = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
        llm.generate(prompts, greedy)                      # compiles
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        seconds = time.perf_counter() - start
        llm.close()
        rows.append({"weights": name, "file_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
                     "load_s": load_s, "device_bytes": device_bytes,
                     "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="capacity,logprob,weights")
    p.add_argument("--models", default="tiny,small", help="presets for the logprob part")
    p.add_argument("--tokens", type=int, default=512, help="generated tokens of the logprob part")
    p.add_argument("--root", default=None, help="where the preset checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    root = Path(args.root or tempfile.mkdtemp(prefix="qnext-fp8-"))
    if "capacity" in parts:
        print("| model | max_model_len | KV tokens bf16 | KV tokens fp8 | ratio | snapshot rows |\n|---|---|---|---|---|---|")
        for r in capacity_rows():
            print(f"| {r['model']} | {r['max_model_len']} | {r['bf16_tokens']} | {r['fp8_tokens']} | "
                  f"{r['ratio']:.2f}x | {r['snapshot_rows']} |")
    if "logprob" in parts:
        from qnext.bench.presets import bench_checkpoint

        print("\n| preset | generated tokens | max abs logprob error | mean abs | argmax agreement |\n|---|---|---|---|---|")
        for name in args.models.split(","):
            r = logprob_error(bench_checkpoint(name, root), args.tokens)
            print(f"| {name} | {r['tokens']} | {r['max_abs']:.4f} | {r['mean_abs']:.5f} | "
                  f"{100 * r['argmax_agreement']:.1f}% |")
    if "weights" in parts:
        print("\n| small, weights | safetensors | load s | device bytes | decode tok/s |\n|---|---|---|---|---|")
        for r in weights_rows(root):
            print(f"| {r['weights']} | {r['file_bytes'] / 2**20:.1f} MiB | {r['load_s']:.2f} | "
                  f"{r['device_bytes'] / 2**20:.1f} MiB | {r['tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main()
