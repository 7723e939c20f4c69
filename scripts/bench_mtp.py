"""MTP speculative decoding against plain decoding, side by side in one run: greedy decode tokens/s at batch 1 and 16
on a bench checkpoint whose MTP head scripts/train_mtp.py trained, the acceptance length the engine reached, and the
speedup that acceptance length should give on this machine from the measured step costs:

    expected speedup = A * t_decode / t_spec        A: tokens a verify pass keeps (1 + accepted drafts)
                                                    t_decode: a plain decode step; t_spec: a speculative step
                                                    (verify pass over k + 1 positions + the head's k drafts)

Prompts are random tokens drawn apart from train_mtp.py's (held out), or with --prompt-source corpus (the default
for a trained-target `<preset>-lm` checkpoint of scripts/train_bench_target.py) windows of the text corpus's held-out
files (qnext/bench/text_corpus.py), which neither the target nor the head trained on; the engines must emit the same
tokens (greedy), which the bench checks. Each k runs twice: with its head's drafts, and on an engine whose drafter
gives oracle drafts (the plain run's own next tokens: every draft agrees, chosen on the host, so the head does not
run), the ceiling of what the verify step itself can give (--drafts picks either). With a draft token map
(--token-map; train_mtp.py writes one) each k also runs with the head drafting over the map's ids only.
Best of --repeats.

Two throughputs per row: tokens/s over the whole run (prefill steps included), and decode tokens/s (vLLM's
inter-token rate: the tokens after each prompt's first over the time after its prefill step; an MTP engine's prefill
step also runs the head's catch-up over the prompt, which counts toward the first token there).

    python scripts/train_mtp.py --preset small          # once: trains and saves the head into the checkpoint
    python scripts/bench_mtp.py [--preset small] [--k 2,3] [--batches 1,16] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--model", help="checkpoint directory with an MTP head (default: the --preset bench checkpoint)")
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--k", default="2", help="num_speculative_tokens, or a comma list (one engine each)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=16, help="as train_mtp.py's prompts")
    p.add_argument("--prompt-source", choices=("auto", "random", "corpus"), default="auto",
                   help="random token ids, or held-out windows of the text corpus (auto: corpus for a -lm checkpoint)")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=4,
                   help="groups of `batch` held-out prompts run one after another per measurement (batch 1: that "
                        "many prompts, each alone)")
    p.add_argument("--disable-by-batch-size", type=int,
                   help="also run each k with speculative_config's disable_by_batch_size set to this (head drafts)")
    p.add_argument("--token-map", default="auto",
                   help="also run each k with this draft token map (speculative_config's speculative_token_map; "
                        "auto: the checkpoint's mtp_token_map.npy when train_mtp.py wrote one; none: skip)")
    p.add_argument("--drafts", default="head,oracle",
                   help="which drafters run each k: head (the MTP head's), oracle (the plain run's own next tokens, "
                        "chosen on the host: the verify step alone), or both")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="what a step's time is: wall seconds, or this process's CPU seconds (all its threads: the "
                        "work a step did, for a machine shared with other jobs, where wall time is mostly waiting)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json-out", type=Path)
    return p.parse_args(argv)


def run(llm, groups: list[list[list[int]]], output_len: int, clock=time.perf_counter) -> dict:
    """Greedy generation of each group of prompts as one batch, group after group, step by step: wall time,
    tokens (all groups' prompts in order), and each step's time by kind (by `clock`)."""
    from qnext import SamplingParams

    engine, stats = llm.engine, llm.engine.stats
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    steps = {"decode": [], "spec": [], "other": []}
    tokens, wall, first_token_wall = [], 0.0, 0.0
    for g, prompts in enumerate(groups):
        ids = [f"b{time.perf_counter_ns()}-{g}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        outputs = {}
        start = clock()
        while engine.has_unfinished_requests():
            rows, prefill = stats.num_spec_rows, stats.num_prefill_tokens
            t0 = clock()
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            dt = clock() - t0
            kind = "spec" if stats.num_spec_rows > rows else "other" if stats.num_prefill_tokens > prefill else "decode"
            steps[kind].append(dt)
            if kind == "other":                 # prefill steps: the prompts' first tokens (and the head's catch-up)
                first_token_wall += dt
        wall += clock() - start
        for rid in ids:
            engine.release(rid)
        tokens += [outputs[rid] for rid in ids]
    decode_tokens = sum(len(t) - 1 for t in tokens)
    return {"wall": wall, "tokens": tokens, "tok_s": sum(map(len, tokens)) / wall,
            "decode_tok_s": decode_tokens / (wall - first_token_wall),
            "steps": {k: float(np.median(v)) if v else None for k, v in steps.items()},
            "num_steps": {k: len(v) for k, v in steps.items()}}


def best_of(llm, prompts, output_len: int, repeats: int, clock=time.perf_counter) -> dict:
    """The fastest of `repeats` runs, with the acceptance length over all of them."""
    stats = llm.engine.stats
    rows, accepted = stats.num_spec_rows, stats.num_accepted_draft_tokens
    runs = [run(llm, prompts, output_len, clock) for _ in range(repeats)]
    best = max(runs, key=lambda r: r["tok_s"])
    best["decode_tok_s"] = max(r["decode_tok_s"] for r in runs)
    spec_rows = stats.num_spec_rows - rows
    best["acceptance_length"] = 1 + (stats.num_accepted_draft_tokens - accepted) / spec_rows if spec_rows else None
    return best


def held_out_prompts(corpus, cfg, batch: int, prompt_len: int, rng: np.random.Generator):
    """`batch` prompts the head never trained on: random token ids from `rng` (corpus None), or the corpus's
    held-out windows at the midpoints of `batch` equal parts of the held-out stream (batch 1: its middle, not its
    first tokens)."""
    if corpus is None:
        return rng.integers(3, cfg.vocab_size, (batch, prompt_len)).tolist()
    return corpus.held_out_prompts(2 * batch + 1, prompt_len)[1::2]


def main(argv=None) -> dict:
    args = parse_args(argv)
    from qnext import LLM
    from qnext.bench.oracle_drafts import continuation_drafts, oracle_drafter
    from qnext.bench.presets import bench_checkpoint, is_lm_checkpoint
    from qnext.bench.text_corpus import load_corpus
    from qnext.config import ModelConfig
    from qnext.engine.startup_heap import freeze_startup_heap
    from qnext.model.mtp import load_mtp_params

    path = Path(args.model) if args.model else bench_checkpoint(args.preset, args.out_dir)
    cfg = ModelConfig.from_pretrained(path)
    if load_mtp_params(path, cfg) is None:
        raise SystemExit(f"{path} has no MTP head: run `python scripts/train_mtp.py --preset {args.preset}` first")
    batches, ks = [int(b) for b in args.batches.split(",")], [int(k) for k in str(args.k).split(",")]
    common = dict(max_num_seqs=max(batches), max_num_batched_tokens=max(256, max(batches) * args.prompt_len),
                  enable_prefix_caching=False, max_model_len=args.prompt_len + args.output_len + 2 * max(ks) + 16,
                  dtype=args.dtype, kv_cache_memory_bytes=1 << 30)     # several engines share one device
    plain = LLM(path, **common)
    continuations = {}                           # the plain run's tokens of each batch's prompts: oracle drafts
    spec = {}
    drafters = set(args.drafts.split(","))
    if not drafters or drafters - {"head", "oracle"}:
        raise SystemExit(f"--drafts takes head, oracle or both, got {args.drafts!r}")
    for k in ks:
        config = {"method": "mtp", "num_speculative_tokens": k}
        if "head" in drafters:
            spec[(k, "head")] = LLM(path, speculative_config=config, **common)
        if "oracle" in drafters:
            spec[(k, "oracle")] = LLM(path, speculative_config=config, **common,
                                      drafter=oracle_drafter(continuation_drafts(continuations, k)))
    token_map = resolve_token_map(args.token_map, path) if "head" in drafters else None
    if token_map is not None:
        size = len(np.load(token_map)) if token_map.endswith(".npy") else len(json.loads(Path(token_map).read_text()))
        spec.update({(k, f"head, token map {size}"): LLM(path, speculative_config={
            "method": "mtp", "num_speculative_tokens": k, "speculative_token_map": token_map}, **common) for k in ks})
    if args.disable_by_batch_size is not None:
        limit = args.disable_by_batch_size
        spec.update({(k, f"head, disable_by_batch_size={limit}"): LLM(path, speculative_config={
            "method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": limit}, **common) for k in ks})
    freeze_startup_heap()
    clock = time.process_time if args.clock == "process" else time.perf_counter
    rng = np.random.default_rng(12345)           # train_mtp.py draws its prompts from seed 0
    source = args.prompt_source if args.prompt_source != "auto" else "corpus" if is_lm_checkpoint(path) else "random"
    corpus = load_corpus(path) if source == "corpus" else None          # tokenised once, for every batch size
    report = {"model": str(path), "clock": args.clock, "prompt_source": source, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "dtype": args.dtype, "rows": []}
    for b in batches:
        prompts = held_out_prompts(corpus, cfg, b * args.rounds, args.prompt_len, rng)
        groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
        for llm in [plain, *spec.values()]:                     # compile this batch's shapes, untimed
            run(llm, groups[:1], 4)
        base = best_of(plain, groups, args.output_len, args.repeats, clock)
        t_decode = base["steps"]["decode"]
        continuations.update({tuple(p): t for p, t in zip(prompts, base["tokens"])})
        for (k, drafts), llm in spec.items():
            r = best_of(llm, groups, args.output_len, args.repeats, clock)
            a, t_spec = r["acceptance_length"], r["steps"]["spec"]
            row = {"batch": b, "k": k, "drafts": drafts, "plain_tok_s": base["tok_s"], "mtp_tok_s": r["tok_s"],
                   "speedup": r["tok_s"] / base["tok_s"], "plain_decode_tok_s": base["decode_tok_s"],
                   "mtp_decode_tok_s": r["decode_tok_s"],
                   "decode_speedup": r["decode_tok_s"] / base["decode_tok_s"],
                   "acceptance_length": a,
                   "t_decode_ms": t_decode * 1e3, "t_spec_ms": t_spec * 1e3 if t_spec else None,
                   "expected_speedup": a * t_decode / t_spec if a and t_spec else None,
                   "tokens_equal": r["tokens"] == base["tokens"], "steps": r["num_steps"]}
            report["rows"].append(row)
            spec_part = (f"acceptance length {a:.2f} | decode step {row['t_decode_ms']:.1f} ms, speculative step "
                         f"{row['t_spec_ms']:.1f} ms -> expected {row['expected_speedup']:.2f}x" if a and t_spec
                         else "no speculative step")
            print(f"batch {b:>3} k={k} {drafts} drafts: plain {row['plain_tok_s']:7.1f} tok/s | MTP "
                  f"{row['mtp_tok_s']:7.1f} tok/s | {row['speedup']:.2f}x "
                  f"(decode only: {row['decode_speedup']:.2f}x)"
                  f" | {spec_part} | tokens equal: {row['tokens_equal']}", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    return report


def resolve_token_map(choice: str, path: Path) -> str | None:
    """--token-map: a path, none, or auto (the checkpoint's own map file when it has one)."""
    from qnext.model.draft_vocab import TOKEN_MAP_FILE

    if choice == "none":
        return None
    if choice == "auto":
        return str(path / TOKEN_MAP_FILE) if (path / TOKEN_MAP_FILE).is_file() else None
    return choice


if __name__ == "__main__":
    main()
