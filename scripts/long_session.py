"""Long sessions on the tiny model: prefill tokens/s, peak RSS and snapshot bytes at growing prompt lengths.

    python scripts/long_session.py                              # 8k, 32k, 128k, 256k (the 256k run takes a while)
    python scripts/long_session.py --lengths 8192 32768 --json-out bench_out/long-session.json

Each length runs in a fresh process (so its peak RSS is its own): a tiny Qwen3.5 checkpoint with random weights
(max_position_embeddings = the length + room for turn 2), one engine with max_num_seqs 1, turn 1 = a prompt of
random token ids of that length (chunked prefill, --chunk tokens a step, one output token) after a warm-up request
of 2 chunks (the prefill step shapes compile there), turn 2 = turn 1's prompt and reply plus a --question-tokens
question. Reported per length: turn 1's wall time and prefill tokens/s, turn 2's time and cached tokens, the
process's peak RSS, the cache's bytes (KV pool + state rows, allocated up front for max_model_len) and peak RSS
minus them (what grows with the length outside the pool, if anything), and the snapshots the session captured
with their bytes.
docs/long-context.md has the numbers."""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def run_length(length: int, chunk: int, question_tokens: int, out_dir: Path) -> dict:
    """One length in this process (the child side)."""
    import numpy as np

    import qnext
    from qnext import SamplingParams
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    max_len = length + question_tokens + 64
    path = write_tiny_checkpoint(out_dir / f"tiny-{length}", "qwen3_5", seed=0, max_position_embeddings=max_len)
    llm = qnext.LLM(path, max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=max_len,
                    compilation_cache_dir="none")
    info = llm.cache_info()
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()          # warm-up: the step shapes of a prefill compile here, not in turn 1
    llm.generate([{"prompt_token_ids": rng.integers(3, 500, 2 * chunk + question_tokens).tolist()}], params)
    warm_up = time.perf_counter() - start
    captured_before = llm.engine.cache_stats.snapshots_captured
    rss_ready = _peak_rss()
    prompt = rng.integers(3, 500, length).tolist()
    start = time.perf_counter()
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    turn1 = time.perf_counter() - start
    reply = first.outputs[0].token_ids
    second_prompt = prompt + list(reply) + rng.integers(3, 500, question_tokens).tolist()
    start = time.perf_counter()
    second = llm.generate([{"prompt_token_ids": second_prompt}], params)[0]
    turn2 = time.perf_counter() - start
    stats = llm.engine.cache_stats
    rows = 1 + info["num_live_rows"] + info["num_snapshot_rows"]
    row_bytes = info["state_bytes"] // rows
    cache_bytes = info["kv_bytes"] + info["state_bytes"]
    peak = _peak_rss()
    llm.close()
    return {"length": length, "chunk": chunk, "warm_up_s": round(warm_up, 2), "turn1_s": round(turn1, 2),
            "prefill_tok_s": round(length / turn1, 1),
            "turn2_prompt": len(second_prompt), "turn2_cached": second.num_cached_tokens, "turn2_s": round(turn2, 3),
            "peak_rss_mib": round(peak / MIB, 1), "rss_at_start_mib": round(rss_ready / MIB, 1),
            "cache_mib": round(cache_bytes / MIB, 1), "peak_rss_minus_cache_mib": round((peak - cache_bytes) / MIB, 1),
            "snapshots_captured": stats.snapshots_captured - captured_before, "snapshot_row_bytes": row_bytes,
            "snapshot_bytes_per_session": (stats.snapshots_captured - captured_before) * row_bytes}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024          # Linux reports KiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072, 262144])
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens: prompt tokens a step")
    p.add_argument("--question-tokens", type=int, default=64, help="turn 2's new tokens")
    p.add_argument("--json-out", help="write the rows here")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run_length(args.child, args.chunk, args.question_tokens, Path(tmp))))
        return
    rows = []
    print(f"{'length':>8} {'turn 1 s':>9} {'prefill tok/s':>13} {'turn 2 cached':>15} {'turn 2 s':>8} "
          f"{'peak RSS MiB':>12} {'cache MiB':>9} {'RSS - cache':>11} {'snapshots':>9} {'snap KiB':>8}", flush=True)
    for length in args.lengths:
        cmd = [sys.executable, __file__, "--child", str(length), "--chunk", str(args.chunk),
               "--question-tokens", str(args.question_tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append(r)
        print(f"{r['length']:>8} {r['turn1_s']:>9} {r['prefill_tok_s']:>13} "
              f"{r['turn2_cached']:>7}/{r['turn2_prompt']:<7} {r['turn2_s']:>8} {r['peak_rss_mib']:>12} "
              f"{r['cache_mib']:>9} {r['peak_rss_minus_cache_mib']:>11} {r['snapshots_captured']:>9} "
              f"{r['snapshot_bytes_per_session'] / 1024:>8.1f}", flush=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
