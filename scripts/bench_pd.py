"""Prefill/decode disaggregation against one instance, on loopback: the chat workload of bench_serving.py through
`qnext pd-router` over a `--pd-role prefill` and a `--pd-role decode` server, and against one `qnext serve`, one
after the other (docs/pd.md).

    python scripts/bench_pd.py                                  # tiny demo model
    python scripts/bench_pd.py --model DIR --server-args "--max-num-seqs 32 --max-num-batched-tokens 512"

Reports bench_serving's table (TTFT, TPOT, output tokens/s; "cached" is what the serving engine reports: on the
decode server every prompt token is cached or transferred) and, from the decode server's /metrics, the share of
prompt tokens its own prefix cache held (the rest came from the prefill server) and the bytes moved."""
from __future__ import annotations

import asyncio
import contextlib
import shlex
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_serving import CHAT_SERVER_ARGS, bench_one, parse_args, report, table  # noqa: E402


def counters(base_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("qnext:") and " " in line:
            name = line.split("{")[0].split(" ")[0].removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def main(argv=None) -> int:
    from qnext.server.launch import ServerProcess, running_server

    args = parse_args(argv)
    server_args = ([args.model] if args.model else []) + shlex.split(args.server_args or CHAT_SERVER_ARGS) + [
        "--block-size", str(args.block_size), "--log-level", "warning"]
    logs = Path(tempfile.mkdtemp(prefix="qnext-bench-pd-"))
    summaries = []
    print(f"one instance: qnext serve {' '.join(server_args)}", file=sys.stderr)
    with running_server(server_args, timeout=900, log_path=logs / "one.log") as server:
        summaries.append(asyncio.run(bench_one(server.base_url, "1 instance", args)))
    with contextlib.ExitStack() as stack:
        roles = {}
        for role in ("prefill", "decode"):
            source = ["--pd-prefill-url", roles["prefill"].base_url] if role == "decode" else []
            roles[role] = ServerProcess(server_args + ["--pd-role", role, *source], log_path=logs / f"{role}.log")
            stack.callback(roles[role].stop)
        for proc in roles.values():
            proc.wait_healthy(900)
        router = ServerProcess(["pd-router", "--prefill", roles["prefill"].base_url, "--decode",
                                roles["decode"].base_url, "--log-level", "warning"], log_path=logs / "router.log")
        stack.callback(router.stop)
        router.wait_healthy(60)
        before = counters(roles["decode"].base_url)          # the warm-up's requests are not counted
        summary = bench_one(router.base_url, "prefill+decode", args)
        summary = asyncio.run(summary)
        after = counters(roles["decode"].base_url)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        own, moved = delta.get("qnext:prefix_cache_hits", 0.0), delta.get("qnext:prefix_cache_transferred", 0.0)
        summary["decode_own_cache_share"] = own / (own + moved) if own + moved else 0.0
        summary["decode_transferred_tokens"] = moved
        summary["transfer_bytes_per_request"] = delta.get("qnext:pd_transfer_bytes", 0.0) / max(
            1.0, delta.get("qnext:pd_transferred_requests", 0.0))
        summary["transfer_ms_per_request"] = 1000 * delta.get("qnext:pd_transfer_seconds", 0.0) / max(
            1.0, delta.get("qnext:pd_transferred_requests", 0.0))
        summary["transfer_min_bytes_per_request"] = delta.get("qnext:pd_transfer_min_bytes", 0.0) / max(
            1.0, delta.get("qnext:pd_transferred_requests", 0.0))
        summaries.append(summary)
    print(table(summaries))
    pd = summaries[-1]
    print(f"decode side: {pd['decode_own_cache_share']:.1%} of the prompt tokens it did not compute came from its own "
          f"prefix cache, {pd['decode_transferred_tokens']:.0f} tokens' KV from the prefill server; "
          f"{pd['transfer_bytes_per_request'] / 1024:.1f} KiB moved per request (minimum "
          f"{pd['transfer_min_bytes_per_request'] / 1024:.1f} KiB), {pd['transfer_ms_per_request']:.1f} ms per fetch")
    return report(summaries, args.json_out, args)


if __name__ == "__main__":
    sys.exit(main())
