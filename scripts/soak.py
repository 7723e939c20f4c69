"""Soak: `qnext serve` and its multi-process shapes under mixed load from the real SDKs, with faults injected.

    python scripts/soak.py --shape all --duration 1200 --concurrency 6 --json-out bench_out/soak.json

For each shape (single, dp, pd: qnext/soak/shapes.py) on 127.0.0.1 with the demo checkpoint: the greedy probes are
answered alone first; then `--concurrency` clients send the request mix (qnext/soak/requests.py: three APIs,
streaming, n > 1, forced calls, JSON schemas, pictures, long prompts, ~5% bad inputs, clients that leave mid-stream,
never read or abort) for `--duration` seconds while the shape's faults are injected in the first half. It passes
when no request got a 5xx but a designed 503 (or, for a restart, a refused connection) inside a fault's window, none
went unanswered past the deadline, every greedy probe equals its answer alone, each fault's own checks hold, RSS grew
< 2% and file descriptors and threads stayed flat over the second half, and the pools are empty once idle.
Exit status 0 when every shape passed; the report (JSON) has the counts."""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qnext.soak.judge import (FaultWindow, Outcome, judge_idle, judge_outcomes, judge_resources,  # noqa: E402
                              resource_growth)
from qnext.soak.monitor import ProcessMonitor  # noqa: E402
from qnext.soak.requests import PROBES, REQUEST_DEADLINE_S, WEIGHTS, RequestMix, Target  # noqa: E402
from qnext.soak.shapes import SHAPES, Shape  # noqa: E402

IDLE_WAIT_S = 60.0


def run_load(mix: RequestMix, duration: float, concurrency: int, seed: int, shape: Shape,
             log=print) -> tuple[list[Outcome], list[FaultWindow], list[str]]:
    """The clients and the fault injector, for `duration` seconds from now -> outcomes, fault windows, problems."""
    outcomes: list[Outcome] = []
    windows: list[FaultWindow] = []
    problems: list[str] = []
    lock = threading.Lock()
    end = time.monotonic() + duration

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < end:
            outcome = mix.send(mix.pick(rng), rng)
            with lock:
                outcomes.append(outcome)
            if outcome.status in ("connection", 503):
                time.sleep(1.0)                  # a client backs off while the server restarts or sheds load

    def injector() -> None:
        for fault in sorted(shape.faults, key=lambda f: f.at):
            wait = mix.t0 + fault.at * duration - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            start = time.monotonic() - mix.t0
            log(f"  [{start:7.1f}s] fault: {fault.name}")
            try:
                found = fault.inject(shape)
                if fault.shape_wide:            # restarted: warm before the load measures it again
                    mix.warm()
            except Exception as e:           # a fault that cannot be injected or checked is a failure of the run
                found = [f"{fault.name}: {type(e).__name__}: {e}"]
            stop = duration + REQUEST_DEADLINE_S if fault.terminal else time.monotonic() - mix.t0
            windows.append(FaultWindow(fault.name, start, stop, fault.shape_wide, fault.drains))
            problems.extend(f"{fault.name}: {p}" if not p.startswith("(") else p for p in found)
            log(f"  [{time.monotonic() - mix.t0:7.1f}s] fault over: {fault.name} {found or ''}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    threads.append(threading.Thread(target=injector, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + 600)
    return outcomes, windows, problems


def wait_idle(shape: Shape) -> None:
    deadline = time.monotonic() + IDLE_WAIT_S
    while time.monotonic() < deadline:
        health = shape.health()
        if health.get("num_requests_running") == 0 and health.get("num_requests_waiting") == 0:
            return
        time.sleep(1)


def soak_shape(name: str, args, work_dir: Path, log=print) -> dict:
    shape = SHAPES[name](work_dir)
    log(f"{name}: starting")
    shape.start()
    try:
        kinds = {k for k in WEIGHTS if shape.kinds_filter(k)}
        mix = RequestMix(Target(shape.base_url, shape.model, shape.max_model_len), kinds)
        mix.probe_answers = {p: mix.probe(p) for p in PROBES}          # each alone, before any load
        mix.warm()
        monitor = ProcessMonitor(shape.roots, interval_s=args.sample_every).start()
        mix.t0 = time.monotonic()
        log(f"{name}: load for {args.duration:.0f}s with {args.concurrency} clients")
        outcomes, windows, problems = run_load(mix, args.duration, args.concurrency, args.seed, shape, log)
        offset = mix.t0 - monitor.t_start
        terminal = [offset + f.at * args.duration for f in shape.faults if f.terminal]
        if not terminal:                           # (a shape that lost a rank for good has no idle state to check)
            wait_idle(shape)
        time.sleep(2 * args.sample_every)                              # idle samples close the window
        samples = monitor.stop()
        idle = [] if terminal else judge_idle(shape.metrics_text())
        probes_after = {} if terminal else {p: mix.probe(p) for p in PROBES}
        restarted = [offset + w.end for w in windows if w.shape_wide]     # a restart's window ends once it is warm
        growth = resource_growth(samples, max([offset + args.duration / 2, *restarted]),
                                 until=min(terminal, default=None))
    finally:
        exit_codes = shape.stop()
    verdict = judge_outcomes(outcomes, windows)
    wrong = (verdict.unexpected + [p for p in problems if not p.startswith("(")] + judge_resources(growth) + idle
             + [f"probe {p!r} after the load: {probes_after[p]!r} != alone {a!r}"
                for p, a in mix.probe_answers.items() if p in probes_after and probes_after[p] != a]
             + [f"{k} exited {c} after SIGTERM" for k, c in exit_codes.items() if c not in (0, -9)])
    return {"shape": name, "duration_s": args.duration, "concurrency": args.concurrency,
            "requests": len(outcomes), "requests_per_s": round(len(outcomes) / args.duration, 2),
            "faults": [{"name": w.name, "at_s": round(w.start, 1), "lasted_s": round(w.end - w.start, 1)}
                       for w in windows],
            "not_injected": [p for p in problems if p.startswith("(")],
            "designed_answers": dict(verdict.designed), "counts": dict(sorted(verdict.counts.items())),
            "resources_second_half": growth, "unexpected": wrong[:50], "num_unexpected": len(wrong),
            "passed": not wrong, "work_dir": str(work_dir)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load per shape")
    p.add_argument("--concurrency", type=int, default=6, help="clients sending at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between resource samples")
    p.add_argument("--work-dir", help="logs and the persisted cache (default: a temporary directory, kept)")
    p.add_argument("--json-out", help="write the report here")
    args = p.parse_args(argv)
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="qnext-soak-"))
    reports = []
    for name in (SHAPES if args.shape == "all" else [args.shape]):
        (root / name).mkdir(parents=True, exist_ok=True)
        report = soak_shape(name, args, root / name, log=lambda m: print(m, flush=True))
        reports.append(report)
        print(json.dumps({k: v for k, v in report.items() if k != "counts"}, indent=1), flush=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(reports, indent=1))
    passed = all(r["passed"] for r in reports)
    print(f"soak {'passed' if passed else 'FAILED'}: " + ", ".join(
        f"{r['shape']} {r['requests']} requests, {len(r['faults'])} faults, {r['num_unexpected']} unexpected"
        for r in reports))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
