"""Fuzz the HTTP APIs from their request schemas: no request may get a 5xx or go unanswered.

    python scripts/fuzz_api.py --requests 5000 --api all          # `qnext serve` (tiny demo) on a free loopback port
    python scripts/fuzz_api.py --requests 300 --api chat --seed 7
    python scripts/fuzz_api.py --api messages --base-url http://127.0.0.1:8000   # a server already running

For each API (chat, completions, messages, count_tokens, responses; `all`: every one), --requests bodies are
generated from the API's JSON schema (qnext/testing/api_fuzz/): about two in three fit it and reach the engine
(cheap: a few tokens each), the rest do not (wrong types, missing and unknown fields, numbers out of range, bytes that
are not JSON); a fifth get an extreme number or an odd string (lone surrogates, NUL, chat-template markup) in place
of one value. Streams are read to the end, some requests are closed early. Then a few GETs (/v1/models, /health,
/metrics), and /health must still answer 200.

Prints the count of each status per API and every failing request (a 5xx, no complete answer within --deadline
seconds, a dropped connection, an error event inside a 200 stream) with the server's log around it; exits 1 if any
failed. Only 127.0.0.1 is contacted; picture URLs point nowhere, and the server keeps refusing http(s) media."""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from qnext.server.launch import running_server
from qnext.testing.api_fuzz import APIS, CaseResult, generate_cases, send_all
from qnext.testing.api_fuzz.cases import get_cases

SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
               "--no-warm-up-cache-check", "--log-level", "info"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000, help="requests per API")
    p.add_argument("--api", choices=[*APIS, "all"], default="all")
    p.add_argument("--seed", type=int, default=0, help="the same seed generates the same requests")
    p.add_argument("--workers", type=int, default=4, help="requests in flight at once")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds a request has to be answered in full")
    p.add_argument("--base-url", help="fuzz this running server instead of starting one")
    p.add_argument("--server-args", default=" ".join(SERVER_ARGS), help="`qnext serve` flags (demo checkpoint)")
    p.add_argument("--log", help="the started server's log (default: a temporary file)")
    p.add_argument("--failures-out", help="write the failing requests here as JSON lines")
    return p.parse_args(argv)


def run(base_url: str, apis: list[str], args: argparse.Namespace) -> dict[str, list[CaseResult]]:
    results: dict[str, list[CaseResult]] = {}
    for api in apis:
        start = time.monotonic()
        cases = generate_cases(api, args.requests, args.seed)
        done, lock = [0], threading.Lock()

        def progress(result: CaseResult, api=api, total=len(cases)) -> None:
            with lock:
                done[0] += 1
                if done[0] % 500 == 0:
                    print(f"  {api}: {done[0]}/{total}", flush=True)

        print(f"{api}: {len(cases)} requests generated in {time.monotonic() - start:.1f}s", flush=True)
        results[api] = send_all(base_url, cases, workers=args.workers, deadline_s=args.deadline,
                                on_result=progress)
        print(f"{api}: sent in {time.monotonic() - start:.1f}s", flush=True)
    results["get"] = send_all(base_url, get_cases(), workers=1, deadline_s=args.deadline)
    return results


def still_healthy(base_url: str) -> str | None:
    try:
        status = httpx.get(base_url + "/health", timeout=30).status_code
    except httpx.HTTPError as e:
        return f"/health did not answer after the fuzz: {e!r}"
    return None if status == 200 else f"/health answered {status} after the fuzz"


def report(results: dict[str, list[CaseResult]], log_path: Path | None) -> list[CaseResult]:
    failures = []
    for api, rs in results.items():
        counts = collections.Counter(r.status if r.status is not None else "none" for r in rs)
        text = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items(), key=lambda kv: str(kv[0])))
        slowest = max((r.seconds for r in rs), default=0.0)
        print(f"{api:>12}: {len(rs)} requests; {text}; slowest {slowest:.1f}s")
        failures += [r for r in rs if r.failed]
    for r in failures:
        print(f"\nFAILED ({r.problem}): {r.case.describe()}\n  answer: {r.answer[:500]}")
    if failures and log_path is not None and log_path.exists():
        tracebacks = [line for line in log_path.read_text(errors="replace").splitlines()
                      if "Traceback" in line or "Error" in line or "-> 5" in line]
        print("\nserver log lines about errors (last 40):\n" + "\n".join(tracebacks[-40:]))
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apis = list(APIS) if args.api == "all" else [args.api]
    start = time.monotonic()
    log_path = None
    if args.base_url:
        results = run(args.base_url.rstrip("/"), apis, args)
        problem = still_healthy(args.base_url.rstrip("/"))
    else:
        log_path = Path(args.log) if args.log else Path(tempfile.mkdtemp(prefix="qnext-fuzz-")) / "server.log"
        print(f"starting `qnext serve {args.server_args}` (log: {log_path})", flush=True)
        with running_server(args.server_args.split(), timeout=600, log_path=log_path) as server:
            results = run(server.base_url, apis, args)
            problem = still_healthy(server.base_url)
    failures = report(results, log_path)
    total = sum(len(rs) for rs in results.values())
    print(f"\n{total} requests, {len(failures)} failed, {time.monotonic() - start:.0f}s in all")
    if args.failures_out:
        with open(args.failures_out, "w") as f:
            for r in failures:
                f.write(json.dumps({"problem": r.problem, "request": r.case.describe(10**6)}) + "\n")
    if problem:
        print(problem)
    return 1 if failures or problem else 0


if __name__ == "__main__":
    sys.exit(main())
