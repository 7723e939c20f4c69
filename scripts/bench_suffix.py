"""Suffix and n-gram drafting against plain decoding, side by side in one run (docs/speculative.md, "Suffix and
n-gram drafting"): greedy decode tokens/s and tokens per decode step at each batch size, per workload:

- repeat: each prompt is sent a second time after its first answer finished (an agent's retried call or a
  regenerated turn: text the server has produced before). Measured on the second pass; the suffix engine drafts
  from its shared index of recent outputs, the n-gram engine from the request's own text only.
- chat: distinct random prompts, each once: nothing repeats, so drafting should cost nothing (rows without drafts
  run plain steps; the per-request gate turns drafting off where drafts fail).

On random weights (the `small` preset) a model does not copy its prompt, so a code-editing workload (a file asked
back with a change) drafts nothing that the target keeps; it needs a trained target (scripts/train_bench_target.py).
The engines must emit the same tokens (checked). One run on a shared machine: compare the ratios, not the absolute
numbers.

    python scripts/bench_suffix.py [--preset small] [--batches 1,8] [--output-len 64] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from qnext.bench.batch_decode import run_batch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--k", type=int, default=7, help="num_speculative_tokens (the most drafts a row verifies)")
    p.add_argument("--json-out", type=Path)
    return p.parse_args(argv)


def run(llm, prompts: list[list[int]], output_len: int) -> dict:
    """Greedy generation of `prompts` as one batch: tokens, decode tokens/s (after each prompt's prefill step) and
    tokens per decode step (steps after the prefill: plain or verify)."""
    from qnext import SamplingParams

    batch = run_batch(llm.engine, prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    return {"tokens": [o.token_ids for o in batch.outputs], "decode_tok_s": batch.decode_tokens / batch.decode_wall_s,
            "tokens_per_step": batch.decode_tokens / batch.decode_steps / len(prompts),
            "decode_steps": batch.decode_steps}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from qnext import LLM
    from qnext.bench.presets import bench_checkpoint

    path = bench_checkpoint(args.preset, args.out_dir)
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(max_num_seqs=max(batches), max_num_batched_tokens=max(256, max(batches) * args.prompt_len),
                  enable_prefix_caching=False, max_model_len=args.prompt_len + args.output_len + args.k + 16,
                  kv_cache_memory_bytes=1 << 30)
    engines = {"plain": LLM(path, **common),
               "suffix": LLM(path, speculative_config={"method": "suffix", "num_speculative_tokens": args.k},
                             **common),
               "ngram": LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4}, **common)}
    vocab = engines["plain"].engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    report = {"preset": args.preset, "k": args.k, "rows": []}
    for batch in batches:
        for workload in ("repeat", "chat"):
            prompts = rng.integers(3, vocab, (batch, args.prompt_len)).tolist()
            results = {}
            for name, llm in engines.items():
                warm = rng.integers(3, vocab, (batch, args.prompt_len)).tolist()
                run(llm, warm, 2 * args.k + 4)                    # compiles this batch's shapes, then its verify
                run(llm, warm, 2 * args.k + 4)                    # windows (the repeat drafts 1 to k tokens)
                if workload == "repeat":
                    run(llm, prompts, args.output_len)            # the first answer: into the shared index
                results[name] = run(llm, prompts, args.output_len)
            for name, r in results.items():
                if r["tokens"] != results["plain"]["tokens"]:
                    raise SystemExit(f"{name} tokens differ from plain decoding's ({workload}, batch {batch})")
                row = {"batch": batch, "workload": workload, "engine": name,
                       "decode_tok_s": round(r["decode_tok_s"], 1), "tokens_per_step": round(r["tokens_per_step"], 2),
                       "speedup": round(r["decode_tok_s"] / results["plain"]["decode_tok_s"], 2)}
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
