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
import dataclasses
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
from qnext.engine.llm_engine import freeze_startup_heap  # noqa: E402
from qnext.bench.transformers_driver import agreement, load_hf, random_prompts, run_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ---- arguments -------------------------------------------------------------------------------------------------------
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


# ---- the machine's limit -------------------------------------------------------------------------------------------
def gemm_rates(cfg, ms: list[int], dtypes: tuple[str, ...], reps: int = 3) -> dict[int, dict[str, dict]]:
    """{m: {dtype: result}}: seconds and FLOP/s of x [m, K] times every weight matrix of the model (distinct weights,
    so weight traffic is real), in `dtype` with float32 accumulation, jitted, the fastest of `reps` (the rate the
    machine reaches when a neighbour does not slow it: the strictest floor), for both weight
    layouts: [K, N] (x @ W) and [N, K] (the engine's, qnext.model.linear). The faster one is the machine's rate
    (`flops_per_s`). Each layout's weights are made once per dtype and timed at every m."""
    import jax
    import jax.numpy as jnp

    from qnext.model.linear import linear

    shapes = matmul_shapes(cfg)
    key = jax.random.PRNGKey(0)
    layouts = {
        "x@W[K,N]": ([(k, n) for k, n in shapes],
                     lambda xs, ws: [jnp.dot(xs[w.shape[0]], w, preferred_element_type=jnp.float32) for w in ws]),
        "linear W[N,K]": ([(n, k) for k, n in shapes],
                          lambda xs, ws: [linear(xs[w.shape[1]], w, preferred_element_type=jnp.float32) for w in ws]),
    }
    seconds = {(m, dtype): {} for m in ms for dtype in dtypes}
    for dtype in dtypes:
        dt = jnp.dtype(dtype)
        for name, (weight_shapes, fn) in layouts.items():
            ws = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dt)
                  for i, s in enumerate(weight_shapes)]
            run = jax.jit(fn)
            for m in ms:
                xs = {k: jax.random.normal(key, (m, k), jnp.float32).astype(dt) for k in {k for k, _ in shapes}}
                jax.block_until_ready(run(xs, ws))
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(run(xs, ws))
                    times.append(time.perf_counter() - t0)
                seconds[m, dtype][name] = min(times)
            del ws
    out: dict[int, dict[str, dict]] = {m: {} for m in ms}
    for (m, dtype), by_layout in seconds.items():
        flops = sum(2 * m * k * n for k, n in shapes)
        sec = min(by_layout.values())
        out[m][dtype] = {"m": m, "dtype": dtype, "seconds": sec, "flops": flops, "flops_per_s": flops / sec,
                         "seconds_by_layout": by_layout}
    return out


def logit_error(path, dtype: str, vocab: int, rng, length: int = 256) -> dict:
    """How far `dtype`'s logits are from float32's on one random prompt of `length` tokens (every position, scored
    through the engine's own step): the largest and RMS absolute difference, the RMS relative to the logits' own
    RMS, and the share of positions whose argmax (the greedy token) agrees."""
    from qnext.model.scoring import load_model

    ids = rng.integers(3, vocab - 8, length).tolist()
    ref = load_model(path, "float32").logits(ids)
    got = load_model(path, dtype).logits(ids)
    err = np.abs(got - ref)
    rms = float(np.sqrt(np.mean(err ** 2)))
    return {"tokens": length, "max_abs": float(err.max()), "rms_abs": rms,
            "rms_relative": rms / float(np.sqrt(np.mean(ref ** 2))),
            "argmax_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1)))}


# ---- qnext ---------------------------------------------------------------------------------------------------------
class StepProfile:
    """Per engine step: its wall time and its phases, read from the engine's own counters (EngineStats): schedule,
    layout (StepInputs), device (the jitted step until its results are ready), sample, postprocess; plus the
    sequences and tokens it ran and how many model steps (a multi-step call runs several)."""

    PARTS = ("schedule", "layout", "device", "sample", "postprocess")
    _COUNTERS = tuple(f"{p}_seconds" for p in PARTS) + ("num_scheduled_sequences", "num_scheduled_tokens",
                                                         "num_model_steps")

    def __init__(self, engine):
        self.engine = engine
        self.records: list[dict] = []

    def step(self):
        stats = self.engine.stats
        before = {k: getattr(stats, k) for k in self._COUNTERS}
        t0 = time.perf_counter()
        outputs = self.engine.step()
        record = {"step": time.perf_counter() - t0}
        delta = {k: getattr(stats, k) - before[k] for k in self._COUNTERS}
        record.update({p: delta[f"{p}_seconds"] for p in self.PARTS})
        record.update(rows=delta["num_scheduled_sequences"], tokens=delta["num_scheduled_tokens"],
                      steps=delta["num_model_steps"])
        if record["rows"]:
            self.records.append(record)
        return outputs


def run_qnext(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """All prompts at once, stepped to completion; per-request TTFT and TPOT from the step that produced them."""
    from qnext.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    compiled = engine.stats.num_compilations
    profile = StepProfile(engine)
    cache0 = dataclasses.asdict(engine.cache_stats)
    t0 = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    first, done, tokens = {}, {}, {}
    try:
        while engine.has_unfinished_requests():
            outs = profile.step()
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, now)
                if o.finished:
                    done[o.request_id] = now
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
    finally:
        for rid in ids:
            engine.release(rid)
    total = max(done.values()) - t0
    compiled = engine.stats.num_compilations - compiled
    cache1 = dataclasses.asdict(engine.cache_stats)
    return {
        "seconds": total,
        "output_tokens_per_s": len(prompts) * output_len / total,
        "ttft_s": [first[r] - t0 for r in ids],
        "tpot_s": [(done[r] - first[r]) / (output_len - 1) for r in ids],
        "tokens": [tokens[r] for r in ids],
        "steps": profile.records,
        "compilations": compiled,
        "cache": {k: cache1[k] - cache0[k] for k in ("prompt_tokens", "reused_tokens", "kv_matched_tokens",
                                                     "lost_to_missing_state_tokens", "snapshots_captured",
                                                     "snapshots_restored")},
    }


def host_summary(steps: list[dict], decode_rows: int | None = None) -> dict:
    """Means per model step (an engine step that ran several decode steps in one call counts as that many);
    with decode_rows, only the decode-only steps of exactly that many sequences."""
    if decode_rows is not None:
        steps = [s for s in steps if s["rows"] == decode_rows and s["tokens"] == decode_rows]
    if not steps:
        return {}
    count = sum(max(1, s["steps"]) for s in steps)
    mean = {k: float(sum(s[k] for s in steps) / count) for k in StepProfile.PARTS + ("step",)}
    host = mean["step"] - mean["device"]
    # the fastest call of the most steps per call: a rate sustained over a few steps, as the bandwidth reader's is
    most = max(max(1, s["steps"]) for s in steps)
    fastest = min(s["step"] / most for s in steps if max(1, s["steps"]) == most)
    return {"num_steps": count, **{f"{k}_s": v for k, v in mean.items()},
            "host_s": host, "host_fraction": host / mean["step"], "step_s_fastest_call": fastest,
            "steps_per_call": most}


# ---- workloads -----------------------------------------------------------------------------------------------------
def engine_options(args, batches: list[int], budget: int, enable_prefix_caching: bool) -> dict:
    """One set of buffer shapes per model (offline and chat engines share every compilation)."""
    chat_len = args.first_message + (args.turns - 1) * (args.message + args.reply) + args.reply
    max_len = max(args.input_len[1] + args.output_len, chat_len) + 1
    max_len = -(-max_len // 16) * 16
    seqs = max(batches + [1])
    return dict(max_num_seqs=seqs, max_num_batched_tokens=max(budget, seqs), max_model_len=max_len, block_size=16,
                dtype=args.dtype, seed=args.seed, max_num_snapshots=2 * seqs,
                num_scheduler_steps=args.num_scheduler_steps, tensor_parallel_size=args.tensor_parallel_size,
                enable_prefix_caching=enable_prefix_caching)


def run_chat(engines: dict, args, vocab: int, rng) -> dict:
    """Chats run one request at a time, turn by turn, alternating cache on / off so load hits both alike. Each turn's
    prompt = the previous prompt + its reply (from the cache-on engine) + a new message."""
    from qnext.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True)

    def one(engine, rid, prompt):
        stats0 = dataclasses.asdict(engine.cache_stats)
        t0 = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        ttft, out = None, None
        while engine.has_unfinished_requests():
            for o in engine.step():
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                if o.finished:
                    out = list(o.outputs[0].token_ids)
        engine.release(rid)
        stats1 = dataclasses.asdict(engine.cache_stats)
        return ttft, out, {k: stats1[k] - stats0[k] for k in ("prompt_tokens", "reused_tokens", "kv_matched_tokens",
                                                              "lost_to_missing_state_tokens")}

    def chat(n_chats, tag, record):
        turns = [dict(turn=k + 1, prompt_len=[], ttft_on_s=[], ttft_off_s=[], reused_tokens=0, kv_matched_tokens=0,
                      lost_to_missing_state_tokens=0, prompt_tokens=0, same_output=0) for k in range(args.turns)]
        for c in range(n_chats):
            prompt = rng.integers(3, vocab - 8, args.first_message).tolist()
            for k in range(args.turns):
                ttft_on, out_on, cache = one(engines[True], f"{tag}-{c}-{k}-on", prompt)
                ttft_off, out_off, _ = one(engines[False], f"{tag}-{c}-{k}-off", prompt)
                t = turns[k]
                t["prompt_len"].append(len(prompt))
                t["ttft_on_s"].append(ttft_on)
                t["ttft_off_s"].append(ttft_off)
                t["same_output"] += out_on == out_off
                for key in ("reused_tokens", "kv_matched_tokens", "lost_to_missing_state_tokens", "prompt_tokens"):
                    t[key] += cache[key]
                prompt = prompt + out_on + rng.integers(3, vocab - 8, args.message).tolist()
        if record:
            for t in turns:
                t["ttft_on_s"], t["ttft_off_s"] = float(np.median(t["ttft_on_s"])), float(np.median(t["ttft_off_s"]))
                t["prompt_len"] = float(np.mean(t["prompt_len"]))
                t["ttft_ratio"] = t["ttft_on_s"] / t["ttft_off_s"]
                t["same_output"] /= n_chats
            return turns
        return None

    chat(1, "chat-warmup", record=False)     # a chat of the same shapes first: compiles, fills both caches alike
    compiled = engines[True].stats.num_compilations   # process-wide: both engines' compilations count
    turns = chat(args.chats, "chat", record=True)
    return {"turns": turns, "chats": args.chats,
            "compilations_while_timed": engines[True].stats.num_compilations - compiled,
            "cache_stats_on": engines[True].cache_stats.as_dict()}


# ---- one model -----------------------------------------------------------------------------------------------------
def set_floors(row: dict, fl: dict) -> None:
    """The row's floors (qnext/bench/bandwidth.py: floors) and each engine's share of them."""
    q, h, tokens = row["qnext"], row.get("hf"), row["batch"] * row["output_len"]
    row.update(floor=fl, floor_seconds=fl["seconds"], floor_output_tokens_per_s=tokens / fl["seconds"],
               gemm_floor_output_tokens_per_s=tokens / fl["gemm_seconds"],
               bandwidth_floor_output_tokens_per_s=tokens / fl["bandwidth_seconds"])
    q["fraction_of_floor"] = fl["seconds"] / q["seconds"]
    step = q["host_full_decode"].get("step_s")
    q["decode_fraction_of_floor"] = fl["decode_step_s"] / step if step else None
    q["decode_fraction_of_bandwidth_floor"] = fl["decode_step_bandwidth_s"] / step if step else None
    fastest = q["host_full_decode"].get("step_s_fastest_call")
    q["decode_fraction_of_bandwidth_floor_fastest_call"] = fl["decode_step_bandwidth_s"] / fastest if fastest else None
    if h:
        h["fraction_of_floor"] = fl["seconds"] / h["seconds"]
        row["floor_over_hf"] = row["floor_output_tokens_per_s"] / h["output_tokens_per_s"]


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


# ---- report --------------------------------------------------------------------------------------------------------
def fmt_s(x):
    return "-" if x is None or x != x else (f"{x * 1e3:.1f}ms" if x < 1 else f"{x:.2f}s")


def targets(results: list[dict]) -> list[dict]:
    out = []
    by = {r["model"]: r for r in results}

    def row(model, batch):
        return next((o for o in by.get(model, {}).get("offline", []) if o["batch"] == batch), None)

    small16 = row("small", 16)
    if small16 and "ratio" in small16:
        r, f = small16["ratio"]["throughput"], small16["qnext"]["fraction_of_floor"]
        out.append({"target": "small b16 throughput >= 2x transformers", "value": r, "met": r >= 2,
                    "needs_fraction_of_floor": 2 / small16["floor_over_hf"]})
        out.append({"target": "small b16 throughput >= 60% of the floor", "value": f, "met": f >= 0.6})
    small1 = row("small", 1)
    if small1 and small1["qnext"].get("decode_fraction_of_bandwidth_floor"):
        f = small1["qnext"]["decode_fraction_of_bandwidth_floor"]
        out.append({"target": "small b1 decode step (mean) >= 85% of the bandwidth floor", "value": f, "met": f >= 0.85})
        f = small1["qnext"]["decode_fraction_of_bandwidth_floor_fastest_call"]
        out.append({"target": "small b1 decode step (fastest call) >= 85% of the bandwidth floor", "value": f,
                    "met": f >= 0.85})
    for b in (16, 64):
        t = row("tiny", b)
        if t and "ratio" in t:
            r = t["ratio"]["throughput"]
            out.append({"target": f"tiny b{b} throughput >= 10x transformers", "value": r, "met": r >= 10,
                        "needs_fraction_of_floor": 10 / t["floor_over_hf"]})
    for name in ("small", "tiny"):
        chat = by.get(name, {}).get("chat")
        if chat and len(chat["turns"]) >= 4:
            r = chat["turns"][3]["ttft_ratio"]
            out.append({"target": f"{name} chat turn-4 TTFT cached <= 0.3x uncached", "value": r, "met": r <= 0.3})
    host = by.get("small", {}).get("host", {}).get("64")
    if host:
        out.append({"target": "small b64 host time per step < 5%", "value": host["host_fraction"],
                    "met": host["host_fraction"] < 0.05})
    return out


def print_report(report: dict) -> None:
    print()
    print(f"qnext bench  dtype={report['dtype']}  {report['machine']}  (JAX compilation excluded: warm-up passes of "
          "the same shapes, no step compiled while timed)")
    for r in report["results"]:
        g = r["gemm"]
        rates = "  ".join(f"M={m}: fp32 {v['float32']['flops_per_s'] / 1e9:.0f} / bf16 "
                          f"{v['bfloat16']['flops_per_s'] / 1e9:.0f}" for m, v in g.items())
        bw = r["bandwidth"]
        err = r.get("logit_error_vs_float32")
        if err:
            print(f"\n{r['model']} {report['dtype']} logits against float32 ({err['tokens']} positions): max abs "
                  f"{err['max_abs']:.3g}, RMS {err['rms_abs']:.3g} ({100 * err['rms_relative']:.1f}% of the logits' "
                  f"RMS), greedy token agrees at {100 * err['argmax_agreement']:.1f}%")
        print(f"\n== {r['model']} ({r['family']}, {r['flops_per_token_matmul'] / 1e6:.1f} MFLOP/token in matmuls)"
              f"  GEMM GFLOP/s at the model's shapes: {rates}  memory bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s "
              f"({bw['reader']})")
        print(f"{'batch':>5} {'qnext tok/s':>11} {'hf tok/s':>9} {'x hf':>6} {'GEMM floor':>10} {'BW floor':>9} "
              f"{'%floor':>6} {'TTFT q':>8} {'TTFT hf':>8} {'TPOT q':>8} {'TPOT hf':>8} {'step q':>8} "
              f"{'GEMM fl':>8} {'BW fl':>8} {'%GEMM':>5} {'%BW':>5} {'host%':>6} {'agree':>6}")
        for o in r["offline"]:
            q, h, fl = o["qnext"], o.get("hf"), o["floor"]
            host = q["host_full_decode"] or q["host_all_steps"]
            step = q["host_full_decode"].get("step_s") or float("nan")
            print(f"{o['batch']:>5} {q['output_tokens_per_s']:>11.1f} "
                  f"{(h['output_tokens_per_s'] if h else float('nan')):>9.1f} "
                  f"{(o['ratio']['throughput'] if h else float('nan')):>6.2f} "
                  f"{o['gemm_floor_output_tokens_per_s']:>10.1f} {o['bandwidth_floor_output_tokens_per_s']:>9.1f} "
                  f"{100 * q['fraction_of_floor']:>5.0f}% {fmt_s(np.mean(q['ttft_s'])):>8} "
                  f"{fmt_s(np.mean(h['ttft_s']) if h else None):>8} {fmt_s(np.mean(q['tpot_s'])):>8} "
                  f"{fmt_s(np.mean(h['tpot_s']) if h else None):>8} {fmt_s(step):>8} "
                  f"{fmt_s(fl['decode_step_gemm_s']):>8} {fmt_s(fl['decode_step_bandwidth_s']):>8} "
                  f"{100 * fl['decode_step_gemm_s'] / step:>4.0f}% {100 * fl['decode_step_bandwidth_s'] / step:>4.0f}% "
                  f"{100 * host['host_fraction']:>5.1f}% "
                  f"{(100 * o['agreement']['identical_outputs'] if h else float('nan')):>5.0f}%")
        print("  GEMM / BW floor: tok/s at this machine's GEMM rate / memory bandwidth; %floor: of the slower of the "
              "two in each phase; step q: one decode step of every row, and its two floors (GEMM fl, BW fl)")
        for o in r["offline"]:
            one = o.get("qnext_one_step_per_call")
            if one:
                print(f"  batch {o['batch']}: one decode step per call {one['output_tokens_per_s']:.1f} tok/s (TPOT "
                      f"{fmt_s(one['tpot_s'])}), {report['args']['num_scheduler_steps']} steps per call "
                      f"{o['qnext']['output_tokens_per_s']:.1f} "
                      f"({o['multi_step_speedup']:.2f}x), same tokens: {one['same_tokens']}")
        for b, host in r["host"].items():
            if host:
                print(f"  host per decode step at batch {b}: step {fmt_s(host['step_s'])} (fastest call of "
                      f"{host['steps_per_call']}: {fmt_s(host['step_s_fastest_call'])} a step), jitted step "
                      f"{fmt_s(host['device_s'])}, outside it {fmt_s(host['host_s'])} "
                      f"({100 * host['host_fraction']:.1f}%: schedule {fmt_s(host['schedule_s'])}, layout "
                      f"{fmt_s(host['layout_s'])}, sample {fmt_s(host['sample_s'])}, postprocess "
                      f"{fmt_s(host['postprocess_s'])})")
        chat = r.get("chat")
        if chat:
            print(f"  multi-turn chat ({chat['chats']} chats, median TTFT per turn, one request at a time):")
            print(f"  {'turn':>4} {'prompt':>6} {'TTFT on':>8} {'TTFT off':>8} {'on/off':>6} {'reused':>6} "
                  f"{'lost':>5} {'same':>5}")
            for t in chat["turns"]:
                print(f"  {t['turn']:>4} {t['prompt_len']:>6.0f} {fmt_s(t['ttft_on_s']):>8} "
                      f"{fmt_s(t['ttft_off_s']):>8} {t['ttft_ratio']:>6.2f} {t['reused_tokens']:>6} "
                      f"{t['lost_to_missing_state_tokens']:>5} {100 * t['same_output']:>4.0f}%")
    if report["targets"]:
        print("\ntargets:")
        for t in report["targets"]:
            needs = t.get("needs_fraction_of_floor")
            needs = f" (that needs {100 * needs:.0f}% of the floor)" if needs else ""
            print(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['value']:.3g}{needs}")
    print(f"\ntotal bench time {report['seconds']:.0f}s")


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(report["results"]):
        c = colors[i % len(colors)]
        rows = r["offline"]
        ax1.plot([o["batch"] for o in rows], [o["qnext"]["output_tokens_per_s"] for o in rows], "o-", color=c,
                 label=f"qnext {r['model']}")
        hf = [o for o in rows if "hf" in o]
        if hf:
            ax1.plot([o["batch"] for o in hf], [o["hf"]["output_tokens_per_s"] for o in hf], "s--", color=c,
                     label=f"transformers {r['model']}")
        ax1.plot([o["batch"] for o in rows], [o["floor_output_tokens_per_s"] for o in rows], ":", color=c,
                 label=f"floor {r['model']} (GEMM or bandwidth)")
        chat = r.get("chat")
        if chat:
            turns = [t["turn"] for t in chat["turns"]]
            ax2.plot(turns, [t["ttft_off_s"] * 1e3 for t in chat["turns"]], "s--", color=c,
                     label=f"{r['model']} cache off")
            ax2.plot(turns, [t["ttft_on_s"] * 1e3 for t in chat["turns"]], "o-", color=c,
                     label=f"{r['model']} cache on")
            ax2.set_xticks(turns)
    ax1.set(xscale="log", yscale="log", xlabel="batch (prompts at once)", ylabel="output tokens/s",
            title=f"offline throughput ({report['dtype']})")
    ax2.set(yscale="log", xlabel="chat turn", ylabel="TTFT (ms)", title="multi-turn chat TTFT, prefix caching")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
        import torch
        import transformers
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
