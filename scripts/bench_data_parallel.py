"""Data parallel serving: bench_serving.py's chat workload on one engine, then on 2 replicas with cache-aware routing
(replicas as processes, then as threads) and with round robin, side by side in one table (cached share of prompt
tokens, TTFT, TPOT, throughput).

    python scripts/bench_data_parallel.py                              # tiny demo model, three servers in turn
    python scripts/bench_data_parallel.py --model DIR --server-args "--max-num-seqs 32" --conversations 48

Any bench_serving.py workload flag passes through (--conversations, --turns, --max-tokens, --request-rate, ...).
On CPU the replicas are XLA host devices sharing the machine's cores: the cached share is what this shows; the
throughput of two replicas needs two real devices."""
from __future__ import annotations

import asyncio
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving  # noqa: E402

RUNS = (("1 engine", []),
        ("2 x cache-aware", ["--data-parallel-size", "2", "--data-parallel-routing", "cache_aware"]),
        ("2 x cache-aware, threads", ["--data-parallel-size", "2", "--data-parallel-routing", "cache_aware",
                                      "--data-parallel-backend", "thread"]),
        ("2 x round-robin", ["--data-parallel-size", "2", "--data-parallel-routing", "round_robin"]))


def main(argv=None) -> int:
    args = bench_serving.parse_args(argv)
    from qnext.server.launch import running_server

    summaries = []
    for label, flags in RUNS:
        server_args = (([args.model] if args.model else []) + shlex.split(args.server_args) + flags
                       + ["--log-level", "warning"])
        log = Path(tempfile.gettempdir()) / f"qnext-bench-dp-{label.replace(' ', '')}.log"
        print(f"starting the server ({label}): qnext serve {' '.join(server_args)}", file=sys.stderr)
        with running_server(server_args, timeout=900, log_path=log) as server:
            summaries.append(asyncio.run(bench_serving.bench_one(server.base_url, label, args)))
    print(bench_serving.table(summaries))
    return bench_serving.report(summaries, args.json_out, args)


if __name__ == "__main__":
    sys.exit(main())
