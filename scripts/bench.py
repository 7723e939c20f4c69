"""qnext against transformers' `generate`, side by side in one run, and against the machine's own floors.

Same checkpoint, dtype and prompts for both engines:
- offline: B prompts of random length at once, fixed output length, ignore_eos, greedy: output tokens/s, TTFT,
  time per output token (TPOT); transformers is driven batched, left-padded with an attention mask.
- floor: the model's matmul FLOPs for the workload (projections, MLP / active experts, lm_head for sampled tokens,
  plus attention scores and delta-rule state terms) over the GEMM rate this machine reaches at the step's shapes
  (the model's own weight matrices at M = the decode batch, and M = 512 prefill rows; the faster of the layouts
  x @ W[K, N] and the engine's W[N, K]), measured in the same run; and the bandwidth floor: the bytes the workload
  must move (every weight once a step, each row's KV and recurrent state; qnext/bench/bandwidth.py) over the memory
  bandwidth this machine streams in the same run (the fastest of a few readers of a buffer the size of the
  weights). Each phase takes the slower of its two floors (prefill is GEMM-bound, small-batch decode is
  bandwidth-bound); "% of floor" is of that binding floor, and "%GEMM" / "%BW" one decode step against each of
  its two floors (the JSON also holds the fastest call's share of the bandwidth floor).
- chat: multi-turn chats (turn k's prompt = history + new message), one request at a time, TTFT per turn with
  prefix caching on and off, and the cache's reuse counters.
- host: time per engine step outside the jitted step (scheduling, cache manager, input building, sampling).

JAX compilation is excluded: each timed qnext pass follows a warm-up pass of the same shapes (same prompt lengths,
other tokens, so the prefix cache cannot hit), and the run checks that no step compiled while timed (if one did,
the pass is rerun). Compilations persist in --out-dir/jax_cache, so a second run starts faster. Both engines get
the same threads (--threads) and alternate in one process; each engine makes --repeats timed passes (alternating,
prompts of the same lengths with new tokens) and its fastest pass is reported, as the floors' rates are the fastest
of their repeats, so a slow spell of a shared machine decides neither the ratio nor the share of the floor.

    python scripts/bench.py --json-out docs/bench/cpu-float32.json --plot docs/bench/cpu-float32.png
    python scripts/bench.py --models small --dtype bfloat16  # on a GPU: same script, Pallas kernels
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qnext.model.host_devices import request_host_devices  # noqa: E402
from qnext.bench.flops import matmul_shapes, workload_flops  # noqa: E402
from qnext.bench.presets import PRESETS, bench_checkpoint  # noqa: E402
from qnext.bench.bandwidth import floors, memory_bandwidth, weight_bytes, workload_bytes  # noqa: E402
from qnext.engine.compilation_cache import enable_compilation_cache  # noqa: E402
from qnext.engine.startup_heap import freeze_startup_heap  # noqa: E402
from qnext.bench.transformers_driver import agreement, load_hf, random_prompts, run_hf  # noqa: E402
from qnext.bench.chat_turns import engine_options, run_chat  # noqa: E402
from qnext.bench.gemm_rates import gemm_rates  # noqa: E402
from qnext.bench.logit_error import logit_error  # noqa: E402
from qnext.bench.report import fmt_s, plot, print_report, set_floors, targets  # noqa: E402
from qnext.bench.step_profile import host_summary, run_qnext  # noqa: E402
from qnext.optional import optional_import  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def per_model(text: str, models: list[str]) -> dict[str, list[int]]:
    """'1,16,64' for every model, or 'tiny:1,16,64 small:1,16' per model."""
    out = {}
    for part in text.split():
        name, _, values = part.rpartition(":")
        batches = [int(v) for v in values.split(",") if v]
        for m in ([name] if name else models):
            out[m] = batches
    return {m: out.get(m, []) for m in models}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,small", help=f"comma list of presets {sorted(PRESETS)}")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batches", default="tiny:1,16,64 small:1,16,64",
                    help="qnext batch sizes: '1,16' for all models or 'tiny:1,16,64 small:1,16'")
    ap.add_argument("--hf-batches", default="tiny:1,16,64 small:1,16", help="transformers batch sizes (same form)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--input-len", default="64:256", help="prompt lengths, uniform in [lo, hi]")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed passes of each engine, alternating; each engine's fastest pass is reported (the "
                         "machine's load varies run to run)")
    ap.add_argument("--chat-models", default=None, help="presets for the chat workload (default: --models)")
    ap.add_argument("--chats", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-message", type=int, default=256, help="tokens in turn 1's prompt")
    ap.add_argument("--message", type=int, default=64, help="tokens of each later user message")
    ap.add_argument("--reply", type=int, default=4, help="tokens generated per turn")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (XLA uses the visible cores)")
    ap.add_argument("--num-scheduler-steps", type=int, default=8,
                    help="qnext's decode steps per jitted call (the engine option; 1: one step a call)")
    ap.add_argument("--one-step-baseline", action="store_true",
                    help="also run qnext with one decode step per call, alternating with the others, and report "
                         "what several steps per call buy")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="qnext's tensor parallelism (the engine option; on CPU that many XLA host devices)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(ROOT / "bench_out"), help="checkpoints and the compilation cache")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--plot", default=None, help="PNG path")
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes: tiny, batches 1,4, 8 tokens, no hf")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.quick:
        models = ["tiny"]
        args.batches, args.hf_batches, args.no_hf = "1,4", "", True
        args.input_len, args.output_len = "16:48", 8
        args.chats, args.turns, args.first_message, args.message, args.reply = 1, 2, 32, 16, 4
    for m in models:
        if m not in PRESETS:
            ap.error(f"model preset {m!r} is not one of {sorted(PRESETS)}")
    args.models = models
    args.batches = per_model(args.batches, models)
    args.hf_batches = {m: [] for m in models} if args.no_hf else per_model(args.hf_batches, models)
    args.chat_models = models if args.chat_models is None else [m for m in args.chat_models.split(",") if m]
    lo, _, hi = args.input_len.partition(":")
    args.input_len = (int(lo), int(hi or lo))
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.output_len < 2:
        ap.error("--output-len must be at least 2 (TPOT needs two tokens)")
    return args


def bench_model(name: str, args, hf_ok: bool, log) -> dict:
    import jax

    import qnext
    from qnext.config import ModelConfig

    preset = PRESETS[name]
    path = bench_checkpoint(name, Path(args.out_dir) / "checkpoints")
    cfg = ModelConfig.from_pretrained(path)
    rng = np.random.default_rng(args.seed)
    batches, hf_batches = args.batches[name], args.hf_batches[name]
    options = engine_options(args, batches, preset.max_num_batched_tokens, enable_prefix_caching=True)
    result = {"model": name, "family": preset.family, "checkpoint": str(path),
              "parameters_per_token_matmul": sum(k * n for k, n in matmul_shapes(cfg)),
              "flops_per_token_matmul": sum(2 * k * n for k, n in matmul_shapes(cfg)),
              "engine_options": options, "offline": [], "host": {},
              "compile": {"step_shapes": 0, "warm_up_seconds": 0.0}}

    if args.dtype != "float32":
        result["logit_error_vs_float32"] = logit_error(path, args.dtype, cfg.vocab_size,
                                                       np.random.default_rng(args.seed + 1))
        log(f"[{name}] {args.dtype} logits against float32: {result['logit_error_vs_float32']}")
    log(f"[{name}] loading qnext ({args.dtype})")
    llm = qnext.LLM(path, **options)
    engine = llm.engine
    one_step = None              # the same engine with one decode step per call (shares its compilations)
    if args.one_step_baseline and options["num_scheduler_steps"] > 1:
        one_step = qnext.LLM(path, **dict(options, num_scheduler_steps=1)).engine
    freeze_startup_heap()        # as a long-running server would (docs/engine.md)

    hf = None
    if hf_batches and hf_ok:
        log(f"[{name}] loading transformers")
        hf = load_hf(path, args.dtype, args.threads)
        run_hf(hf, [[5, 6, 7]], 2, cfg.pad_token_id or 0)

    gemm = gemm_rates(cfg, sorted(set(batches + [min(preset.max_num_batched_tokens, 512)])), ("float32", "bfloat16"))
    result["gemm"] = {str(m): v for m, v in gemm.items()}
    result["bandwidth"] = memory_bandwidth(int(weight_bytes(cfg, "float32", 1)))
    prefill_m = min(preset.max_num_batched_tokens, 512)

    for b in batches:
        prompts = random_prompts(rng, b, args.input_len, cfg.vocab_size)
        warm = [[(t * 7 + 11) % (cfg.vocab_size - 11) + 3 for t in p] for p in prompts]   # same lengths, new tokens
        log(f"[{name}] batch {b}: qnext (after a warm-up pass of the same shapes)")
        w = run_qnext(engine, warm, min(args.output_len, 16), f"warm{b}")
        q = run_qnext(engine, prompts, args.output_len, f"b{b}")
        tokens = q["tokens"]              # of `prompts`, which the other engines' first passes run too
        if q["compilations"]:             # a shape the short warm-up missed: the timed pass is rerun, warm
            log(f"[{name}] batch {b}: {q['compilations']} step shapes compiled while timed; running it again")
            w["compilations"] += q["compilations"]
            q = run_qnext(engine, [[(t * 5 + 1) % (cfg.vocab_size - 11) + 3 for t in p] for p in prompts],
                          args.output_len, f"again{b}")
        result["compile"]["step_shapes"] += w["compilations"] + q["compilations"]
        result["compile"]["warm_up_seconds"] += w["seconds"]
        h_passes, s_passes, q_passes = [], [], [q]
        with_hf = b in hf_batches and hf is not None
        if one_step is not None:
            run_qnext(one_step, warm, min(args.output_len, 16), f"warm{b}-one-step")
        for r in range(args.repeats):     # alternating passes; prompts of the same lengths, new tokens
            again = prompts if r == 0 else [[(t * (2 * r + 3) + 7 * r) % (cfg.vocab_size - 11) + 3 for t in p]
                                            for p in prompts]
            log(f"[{name}] batch {b}: pass {r + 1} of {args.repeats}")
            if r:
                q_passes.append(run_qnext(engine, again, args.output_len, f"b{b}-pass{r}"))
            if one_step is not None:
                s_passes.append(run_qnext(one_step, again, args.output_len, f"b{b}-pass{r}-one-step"))
            if with_hf:
                h_passes.append(run_hf(hf, again, args.output_len, cfg.pad_token_id or 0))
        q = min(q_passes, key=lambda x: x["seconds"])
        q["pass_seconds"] = [x["seconds"] for x in q_passes]
        row = {"batch": b, "prompt_lens": [len(p) for p in prompts], "output_len": args.output_len}
        row["flops"] = workload_flops(cfg, row["prompt_lens"], args.output_len)
        row["bytes"] = workload_bytes(cfg, args.dtype, row["prompt_lens"], args.output_len,
                                      preset.max_num_batched_tokens)
        row["qnext"] = {k: v for k, v in q.items() if k not in ("steps", "tokens")}
        row["qnext"]["host_all_steps"] = host_summary(q["steps"])
        row["qnext"]["host_full_decode"] = host_summary(q["steps"], decode_rows=b)
        result["host"][str(b)] = row["qnext"]["host_full_decode"]
        log(f"[{name}] batch {b}: qnext {q['output_tokens_per_s']:.1f} tok/s, decode step "
            f"{fmt_s(row['qnext']['host_full_decode'].get('step_s'))}")
        if s_passes:
            one = min(s_passes, key=lambda x: x["seconds"])
            row["qnext_one_step_per_call"] = {
                "output_tokens_per_s": one["output_tokens_per_s"], "tpot_s": float(np.mean(one["tpot_s"])),
                "pass_seconds": [x["seconds"] for x in s_passes],
                "host_full_decode": host_summary(one["steps"], decode_rows=b),
                "same_tokens": s_passes[0]["tokens"] == tokens}
            row["multi_step_speedup"] = q["output_tokens_per_s"] / one["output_tokens_per_s"]
        if h_passes:
            h = min(h_passes, key=lambda x: x["seconds"])
            row["hf"] = {k: v for k, v in h.items() if k != "tokens"}
            row["hf"]["pass_seconds"] = [x["seconds"] for x in h_passes]
            row["agreement"] = agreement(tokens, h_passes[0]["tokens"])   # same prompts for both
            row["ratio"] = {"throughput": q["output_tokens_per_s"] / h["output_tokens_per_s"],
                            "ttft": np.mean(q["ttft_s"]) / np.mean(h["ttft_s"]),
                            "tpot": np.mean(q["tpot_s"]) / np.mean(h["tpot_s"])}
            log(f"[{name}] batch {b}: transformers {h['output_tokens_per_s']:.1f} tok/s, agreement "
                f"{100 * row['agreement']['identical_outputs']:.0f}%")
        result["offline"].append(row)
        measured = memory_bandwidth(result["bandwidth"]["bytes"])     # after each batch too: the fastest counts
        if measured["bytes_per_s"] > result["bandwidth"]["bytes_per_s"]:
            result["bandwidth"] = measured

    bw = result["bandwidth"]
    log(f"[{name}] memory bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s ({bw['reader']})")
    for row in result["offline"]:
        set_floors(row, floors(row["flops"], row["bytes"], gemm[prefill_m][args.dtype]["flops_per_s"],
                               gemm[row["batch"]][args.dtype]["flops_per_s"], bw["bytes_per_s"]))
        log(f"[{name}] batch {row['batch']}: {100 * row['qnext']['fraction_of_floor']:.0f}% of the floor "
            f"{row['floor_output_tokens_per_s']:.1f} tok/s (GEMM floor {row['gemm_floor_output_tokens_per_s']:.1f}, "
            f"bandwidth floor {row['bandwidth_floor_output_tokens_per_s']:.1f})")

    if name in args.chat_models:
        log(f"[{name}] multi-turn chat, prefix caching on / off")
        off = qnext.LLM(path, **dict(options, enable_prefix_caching=False)).engine
        engines = {True: qnext.LLM(path, **options).engine, False: off}
        result["chat"] = run_chat(engines, args, cfg.vocab_size, rng)
    del llm, hf, one_step
    jax.clear_caches()
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    request_host_devices(args.tensor_parallel_size)     # before JAX starts
    t0 = time.perf_counter()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import jax

    enable_compilation_cache(str(out_dir / "jax_cache"))       # the engines' default dir is JAX's, once set
    log = functools.partial(print, file=sys.stderr, flush=True)
    hf_ok = False
    if any(args.hf_batches.values()):
        torch = optional_import("torch", "reference", "--hf-batches (transformers' side of the benchmark)")
        transformers = optional_import("transformers", "reference",
                                       "--hf-batches (transformers' side of the benchmark)")
        torch.set_num_threads(args.threads)
        hf_ok = True
        log(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads")
    device = jax.devices()[0]
    machine = f"{device.platform} {device.device_kind}, {platform.processor() or platform.machine()}"
    results = [bench_model(name, args, hf_ok, log) for name in args.models]
    report = {"dtype": args.dtype, "machine": machine, "jax": jax.__version__, "args": vars(args),
              "results": results, "targets": targets(results),
        "seconds": time.perf_counter() - t0}
    print_report(report)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1, default=float) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
