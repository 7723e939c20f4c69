"""The sampler's share of a decode step at a real vocabulary, side by side in one run.

For each batch N and sampling mode: the model's decode step (the engine's jitted step at N rows, greedy, one step
per call: its `device` time), the jitted sampler alone over [N, V] logits (`sample`, what the engine dispatches
after the step), and its top-k / top-p stage both ways: the window (top_k_top_p.py, the engine's) and the full sort
it replaced (`top_k_top_p_by_sort`); the sampler before = sample - window + sort. With --k, the speculative verify:
its acceptance (`spec_decode.accept_rows`, which filters N x (k + 1) rows) against the decode step at N x (k + 1)
rows (the verify's forward runs that many tokens). Per batch, the Gumbel-max draw alone: batched noise (the sampler
before) against a loop over rows (sampler.gumbel_max, now).

Three kinds of logits: `model`, the bench checkpoint's own (random weights, yet peaked: its top token holds
0.6-0.95 of the mass); `peaked`, 64 ids drawn around +20 and the rest around 0 (a nucleus inside the window); `flat`,
standard normal (a top_p row's nucleus is wider than the window: the batch takes the bisection fallback).

    python scripts/bench_sampler.py --model small-248k --batches 1,16 --k 3
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qnext.bench.presets import PRESETS, bench_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOGITS = ("model", "peaked", "flat")
MODES = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=0.8),
         "top_k": dict(temperature=0.8, top_k=20), "top_p": dict(temperature=0.8, top_p=0.95),
         "top_k+top_p": dict(temperature=0.8, top_k=20, top_p=0.95)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-248k", help=f"bench preset {sorted(PRESETS)}")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--k", type=int, default=3, help="speculative tokens per row (0: no verify rows)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {list(MODES)}")
    ap.add_argument("--logits", default=",".join(LOGITS), help=f"comma list of {list(LOGITS)}")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls of each function; the fastest counts")
    ap.add_argument("--out-dir", default=str(ROOT / "bench_out"))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.model not in PRESETS:
        ap.error(f"model preset {args.model!r} is not one of {sorted(PRESETS)}")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    args.logits = [m for m in args.logits.split(",") if m]
    for m in args.logits:
        if m not in LOGITS:
            ap.error(f"logits {m!r} is not one of {list(LOGITS)}")
    for m in args.modes:
        if m not in MODES:
            ap.error(f"mode {m!r} is not one of {list(MODES)}")
    if args.k < 0 or args.repeats < 1:
        ap.error("--k must be >= 0 and --repeats >= 1")
    return args


def fastest(fn, *args, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of a jitted fn, after one call that compiles it."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def decode_step_seconds(path, rows: list[int], vocab: int, rng) -> dict[int, float]:
    """The engine's jitted decode step at each row count (greedy, one step a call): mean device time of the steps
    that decoded exactly that many rows, after a warm-up run of the same shapes."""
    import qnext
    from qnext.sampling_params import SamplingParams

    llm = qnext.LLM(path, max_num_seqs=max(rows), max_num_batched_tokens=1024, max_model_len=512,
                    num_scheduler_steps=1, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = {}
    for n in rows:
        times = []
        for tag in ("warm", "timed"):
            for i in range(n):
                engine.add_request(f"{tag}{n}-{i}", {"prompt_token_ids": rng.integers(3, vocab - 8, 64).tolist()},
                                   params)
            while engine.has_unfinished_requests():
                stats = engine.stats
                device, tokens, seqs = stats.device_seconds, stats.num_scheduled_tokens, stats.num_scheduled_sequences
                engine.step()
                if tag == "timed" and stats.num_scheduled_tokens - tokens == n == stats.num_scheduled_sequences - seqs:
                    times.append(stats.device_seconds - device)
            for i in range(n):
                engine.release(f"{tag}{n}-{i}")
        out[n] = float(np.mean(times))
    return out


def logits_sets(path, rows: int, vocab: int, rng, kinds=LOGITS) -> dict[str, np.ndarray]:
    from qnext.model.scoring import load_model

    out = {}
    if "model" in kinds:
        out["model"] = np.asarray(load_model(path, "float32").logits(rng.integers(3, vocab - 8, rows).tolist()),
                                  np.float32)                                       # [rows, V]
    if "peaked" in kinds:
        out["peaked"] = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
        for r in range(rows):
            out["peaked"][r, rng.choice(vocab, 64, replace=False)] += 20.0
    if "flat" in kinds:
        out["flat"] = rng.standard_normal((rows, vocab)).astype(np.float32)
    return out


def tensors_for(mode: str, rows: int, vocab: int):
    from qnext.engine.sampling_inputs import SamplerInputBuilder, SamplingRow
    from qnext.sampling_params import SamplingParams

    params = SamplingParams(**MODES[mode], seed=0)
    rows_ = [SamplingRow(f"r{i}", params, [1], [], i) for i in range(rows)]
    return SamplerInputBuilder(vocab, seed=0).build(rows_, rows)


def sampler_times(logits: np.ndarray, mode: str, repeats: int) -> dict:
    """sample() over every row, and its top-k / top-p stage by the window and by the full sort."""
    import jax
    import jax.numpy as jnp

    from qnext.engine.sampler import sample
    from qnext.engine.top_k_top_p import apply_top_k_top_p, top_k_top_p_by_sort

    tensors, num_logprobs = tensors_for(mode, *logits.shape)
    x = jnp.asarray(logits)
    out = {"sample_s": fastest(jax.jit(lambda x, t: sample(x, t, num_logprobs=num_logprobs)), x, tensors,
                               repeats=repeats)}
    if tensors.top_k is not None:
        for name, fn in (("window_s", apply_top_k_top_p), ("sort_s", top_k_top_p_by_sort)):
            out[name] = fastest(jax.jit(fn), x, tensors.top_k, tensors.top_p, repeats=repeats)
        out["sample_before_s"] = out["sample_s"] - out["window_s"] + out["sort_s"]
    return out


def draw_times(logits: np.ndarray, repeats: int) -> dict:
    """The Gumbel-max draw of every row: batched noise [N, V] (jax.vmap, the sampler before) against a loop over
    rows (sampler.gumbel_max): the same noise, so the same tokens."""
    import jax
    import jax.numpy as jnp

    from qnext.engine.sampler import first_argmax, gumbel_max

    x = jnp.asarray(logits)
    keys = jax.vmap(jax.random.key)(jnp.arange(x.shape[0]))
    batched = jax.jit(lambda x, keys: first_argmax(
        x + jax.vmap(lambda k: jax.random.gumbel(k, (x.shape[-1],), jnp.float32))(keys)))
    assert (batched(x, keys) == jax.jit(gumbel_max)(x, keys)).all(), "the two draws differ"
    return {"draw_batched_s": fastest(batched, x, keys, repeats=repeats),
            "draw_per_row_s": fastest(jax.jit(gumbel_max), x, keys, repeats=repeats)}


def verify_seconds(logits: np.ndarray, mode: str, k: int, repeats: int) -> float:
    """accept_rows over rows / (k + 1) windows of k + 1 positions; the drafts are each position's argmax, so the
    verify accepts as a well-trained head's would."""
    import jax
    import jax.numpy as jnp

    from qnext.engine.spec_decode import accept_rows

    rows, vocab = logits.shape
    n = rows // (k + 1)
    windows = jnp.asarray(logits[: n * (k + 1)]).reshape(n, k + 1, vocab)
    drafts = jnp.argmax(windows[:, :k], axis=-1).astype(jnp.int32)
    tensors, _ = tensors_for(mode, n, vocab)
    tensors = None if mode == "greedy" else tensors
    return fastest(jax.jit(accept_rows), windows, drafts, tensors, repeats=repeats)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    from qnext.config import ModelConfig

    jax.config.update("jax_compilation_cache_dir", str(Path(args.out_dir) / "jax_cache"))
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    path = bench_checkpoint(args.model, Path(args.out_dir) / "checkpoints")
    vocab = ModelConfig.from_pretrained(path).vocab_size
    rng = np.random.default_rng(0)
    rows = sorted({b for b in args.batches} | ({b * (args.k + 1) for b in args.batches} if args.k else set()))
    log(f"decode steps at {rows} rows")
    steps = decode_step_seconds(path, rows, vocab, rng)
    report = {"model": args.model, "vocab": vocab, "k": args.k, "decode_step_s": steps, "draw": {},
              "results": []}
    for b in args.batches:
        width = b * (args.k + 1) if args.k else b
        sets = logits_sets(path, width, vocab, rng, args.logits)
        report["draw"][b] = draw_times(next(iter(sets.values()))[:b], args.repeats)
        for kind, logits in sets.items():
            for mode in args.modes:
                log(f"batch {b}, {kind} logits, {mode}")
                t = sampler_times(logits[:b], mode, args.repeats)
                if args.k:
                    t["verify_s"] = verify_seconds(logits, mode, args.k, args.repeats)
                report["results"].append({"batch": b, "logits": kind, "mode": mode, **t})
    print_report(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def print_report(report: dict) -> None:
    ms = lambda s: "-" if s is None else f"{1e3 * s:.1f}"  # noqa: E731
    pct = lambda part, step: "-" if part is None else f"{100 * part / (part + step):.0f}%"  # noqa: E731
    steps, k = report["decode_step_s"], report["k"]
    print(f"\n{report['model']} (vocab {report['vocab']:,}): decode step (ms) " +
          ", ".join(f"{n} rows {ms(s)}" for n, s in steps.items()))
    print(f"{'batch':>5} {'logits':>6} {'mode':>11} {'sample':>7} {'share':>5} {'before':>7} {'share':>5} "
          f"{'window':>7} {'sort':>8}" + (f" {'verify k=' + str(k):>9} {'share':>5}" if k else ""))
    for r in report["results"]:
        step = steps[r["batch"]]
        line = (f"{r['batch']:>5} {r['logits']:>6} {r['mode']:>11} {ms(r['sample_s']):>7} "
                f"{pct(r['sample_s'], step):>5} {ms(r.get('sample_before_s')):>7} "
                f"{pct(r.get('sample_before_s'), step):>5} {ms(r.get('window_s')):>7} {ms(r.get('sort_s')):>8}")
        if k:
            line += f" {ms(r['verify_s']):>9} {pct(r['verify_s'], steps[r['batch'] * (k + 1)]):>5}"
        print(line)
    for b, d in report["draw"].items():
        print(f"  batch {b}: the Gumbel-max draw of every row, batched noise {ms(d['draw_batched_s'])} ms, a loop "
              f"over rows (the sampler's) {ms(d['draw_per_row_s'])} ms")
    print("share: of the decode step plus the sampler (verify: of the step at batch x (k + 1) rows plus the "
          "acceptance); before: with the full sort (sample - window + sort)")


if __name__ == "__main__":
    main()
