"""Grammar fast-forward against plain constrained decoding, side by side in one run (docs/structured.md,
"Fast-forward"): engine steps per forced tool call, and decode tokens/s of JSON-schema requests, with
grammar_fast_forward on and off (greedy; the engines must emit the same tokens, checked).

- forced calls: one request at a time (batch 1), each a forced call of `qwen3_coder` format (Qwen3.5's
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n...`), half with a named function (tool_choice named), half
  with tool_choice required over both tools; steps = the engine steps the request took, its prefill's included.
- json: a batch of requests under ORDER_SCHEMA (qnext/bench/grammar_libraries.py: nested objects, an array of
  items, enums, a pattern, a nullable string); decode tokens/s over the steps after the prefill.

Random weights (the `small` preset): free text inside strings is random, so the JSON rows' forced share is what the
schema's keys and punctuation force between random values; a trained model would write shorter, likelier values.
One run on a shared machine: compare the ratios, not the absolute numbers.

    python scripts/bench_grammar_ff.py [--preset small] [--batches 1,4] [--output-len 160] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from qnext.bench.batch_decode import run_batch

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit", "days"]}}} for name in ("get_weather", "get_forecast")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--batches", default="1,4", help="batch sizes of the JSON-schema workload")
    p.add_argument("--calls", type=int, default=6, help="forced calls per engine and repeat")
    p.add_argument("--output-len", type=int, default=160, help="max_tokens of a JSON request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    return p.parse_args(argv)


def generate(llm, prompts: list[list[int]], params) -> dict:
    """Greedy generation of `prompts` as one batch -> tokens, engine steps, decode tokens/s (steps after the
    prefill) and generated tokens per decode step per row."""
    run = run_batch(llm.engine, prompts, params)
    return {"tokens": [o.token_ids for o in run.outputs], "texts": [o.text for o in run.outputs],
            "steps": run.steps, "decode_tok_s": run.decode_tok_s, "tokens_per_step": run.tokens_per_step(len(prompts))}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from qnext import LLM, SamplingParams, StructuredOutputsParams
    from qnext.agents.tool_grammar import tool_call_grammar
    from qnext.bench.grammar_libraries import ORDER_SCHEMA
    from qnext.bench.presets import bench_checkpoint

    path = bench_checkpoint(args.preset, args.out_dir)
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(max_num_seqs=max(batches), max_num_batched_tokens=256, max_model_len=64 + args.output_len + 16,
                  kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    engines = {"plain": LLM(path, grammar_fast_forward=False, **common), "fast-forward": LLM(path, **common)}
    vocab = engines["plain"].engine.model_config.vocab_size
    rng = np.random.default_rng(0)

    def prompts(n: int) -> list[list[int]]:
        return [rng.integers(3, min(vocab, 500) - 3, 24).tolist() for _ in range(n)]

    def constrained(**spec):
        return SamplingParams(temperature=0.0, max_tokens=args.output_len,
                              structured_outputs=StructuredOutputsParams(**spec))

    calls = [constrained(grammar=tool_call_grammar(TOOLS, "qwen3_coder", name="get_weather")),
             constrained(grammar=tool_call_grammar(TOOLS, "qwen3_coder"))]
    json_params = constrained(json=ORDER_SCHEMA)
    for llm in engines.values():                        # warm-up: every shape and variant compiles here
        for params in calls:
            generate(llm, prompts(1), params)
        for b in batches:
            generate(llm, prompts(b), json_params)

    result = {"preset": args.preset, "calls": {}, "json": {}}
    call_steps = {name: [] for name in engines}
    call_tokens = []
    json_runs = {(name, b): [] for name in engines for b in batches}
    for r in range(args.repeats):
        batch = [prompts(1) for _ in range(args.calls)]
        for name, llm in engines.items():
            outs = [generate(llm, p, calls[i % 2]) for i, p in enumerate(batch)]
            call_steps[name] += [o["steps"] for o in outs]
            if name == "plain":
                call_tokens += [len(o["tokens"][0]) for o in outs]
                want_calls = [o["tokens"] for o in outs]
            elif [o["tokens"] for o in outs] != want_calls:
                sys.exit("forced calls: fast-forward's tokens differ from plain decoding's")
        for b in batches:
            batch = prompts(b)
            for name, llm in engines.items():
                out = generate(llm, batch, json_params)
                json_runs[(name, b)].append(out)
            if json_runs[("plain", b)][-1]["tokens"] != json_runs[("fast-forward", b)][-1]["tokens"]:
                sys.exit(f"json batch {b}: fast-forward's tokens differ from plain decoding's")
            print(f"repeat {r + 1} json batch {b}: " + ", ".join(
                f"{name} {json_runs[(name, b)][-1]['decode_tok_s']:.1f} tok/s" for name in engines), flush=True)

    result["calls"] = {"tokens_per_call": float(np.mean(call_tokens)),
                       **{f"{name}_steps_per_call": float(np.mean(s)) for name, s in call_steps.items()}}
    c = result["calls"]
    print(f"forced calls: {c['tokens_per_call']:.1f} tokens a call; steps a call: plain "
          f"{c['plain_steps_per_call']:.1f}, fast-forward {c['fast-forward_steps_per_call']:.1f} "
          f"({c['plain_steps_per_call'] / c['fast-forward_steps_per_call']:.2f}x fewer)")
    for b in batches:
        best = {name: max(json_runs[(name, b)], key=lambda x: x["decode_tok_s"]) for name in engines}
        row = {name: {"decode_tok_s": best[name]["decode_tok_s"], "tokens_per_step": best[name]["tokens_per_step"],
                      "passes": [x["decode_tok_s"] for x in json_runs[(name, b)]]} for name in engines}
        row["speedup"] = best["fast-forward"]["decode_tok_s"] / best["plain"]["decode_tok_s"]
        row["tokens_per_request"] = float(np.mean([len(t) for t in best["plain"]["tokens"]]))
        result["json"][b] = row
        print(f"json batch {b}: {row['tokens_per_request']:.0f} tokens a request; plain "
              f"{row['plain']['decode_tok_s']:.1f} tok/s, fast-forward {row['fast-forward']['decode_tok_s']:.1f} "
              f"tok/s ({row['speedup']:.2f}x), {row['fast-forward']['tokens_per_step']:.2f} tokens a step")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
