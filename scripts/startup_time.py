"""Start-up time, each run twice in fresh processes on one compilation cache directory (the first run fills it,
the second reads it back):

    python scripts/startup_time.py serve                     # `qnext serve` on the tiny demo: launch to /health
    python scripts/startup_time.py serve --tokenizer qwen3.5 # on a tiny checkpoint with Qwen3.5's 248,320 vocabulary
    python scripts/startup_time.py generate                  # the README demo, `python scripts/generate.py`
    python scripts/startup_time.py sampler                   # warm-up's sampler runs at vocab 248,320, old vs new

`serve` also times one 8-token chat request after /health (a start that skipped its warm-up loads the shapes the
request needs then). `generate` reports the run's wall time and the time in JAX's compilation path, from JAX's
monitoring events: tracing, lowering to StableHLO, and the backend step (an XLA compilation, or on a cache hit
reading the executable back), with the cache's hits and misses. --cache-dir defaults to a new temporary directory
(an empty cache); docs/serving.md has the numbers."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# scripts/generate.py under JAX's monitoring listeners; prints one JSON line of totals at the end
_PROBE = """
import collections, json, runpy, sys, time
import jax
seconds, counts = collections.Counter(), collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: seconds.update({name.rsplit("/", 1)[-1]: secs}))
jax.monitoring.register_event_listener(lambda name, **kw: counts.update({name.rsplit("/", 1)[-1]: 1}))
from jax._src import compilation_cache             # the cache's writes are not a monitoring event: timed here
put = compilation_cache.put_executable_and_time


def timed_put(*args, **kwargs):
    start = time.perf_counter()
    try:
        return put(*args, **kwargs)
    finally:
        seconds.update({"cache_write": time.perf_counter() - start})


compilation_cache.put_executable_and_time = timed_put
script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("STARTUP " + json.dumps({"seconds": seconds, "counts": counts}))
"""


def time_generate(cache_dir: Path, extra: list[str]) -> dict:
    env = dict(os.environ, QNEXT_COMPILATION_CACHE_DIR=str(cache_dir))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT / "scripts" / "generate.py"), *extra],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"generate.py failed:\n{proc.stderr[-3000:]}")
    probe = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("STARTUP "))[8:])
    s, c = probe["seconds"], probe["counts"]
    backend = s.get("backend_compile_duration", 0.0)
    return {"wall_s": round(wall, 1), "trace_s": round(s.get("jaxpr_trace_duration", 0.0), 1),
            "lower_s": round(s.get("jaxpr_to_mlir_module_duration", 0.0), 1),
            "backend_compile_or_cache_read_s": round(backend, 1), "backend_share": round(backend / wall, 3),
            "cache_write_s": round(s.get("cache_write", 0.0), 1),
            "cache_hits": c.get("cache_hits", 0), "cache_misses": c.get("cache_misses", 0)}


def time_serve(cache_dir: Path, model: str | None, log_path: Path) -> dict:
    from qnext.server.launch import ServerProcess

    args = ([model] if model else []) + ["--compilation-cache-dir", str(cache_dir), "--log-level", "info"]
    start = time.perf_counter()
    server = ServerProcess(args, log_path=log_path)
    try:
        server.wait_healthy(timeout=3600)
        healthy = time.perf_counter() - start
        body = json.dumps({"model": model or "qnext-tiny-demo", "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Hello!"}]}).encode()
        request = urllib.request.Request(server.base_url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as r:
            assert r.status == 200
        first_request = time.perf_counter() - t0
    finally:
        server.stop()
    log = log_path.read_text(errors="replace")
    warm_up = re.search(r"compiled (\d+) step shapes in ([\d.]+) s", log)
    return {"health_s": round(healthy, 1), "first_request_s": round(first_request, 2),
            "warm_up": f"{warm_up.group(1)} shapes in {warm_up.group(2)} s" if warm_up else "skipped (cached)"}


def time_sampler_warm_up(model: str) -> dict:
    """The sampler runs of a warm-up at the default engine options, in one process, compiled first (untimed): greedy
    and top-p after every step shape (as warm-up did) against plain sampling and top-p once per logits-row count."""
    import jax
    import numpy as np

    import qnext
    from qnext.engine.runner import _sample_rows
    from qnext.engine.sampling_inputs import SamplingRow
    from qnext.sampling_params import SamplingParams

    runner = qnext.LLM(model, compilation_cache_dir="none").engine.runner
    variants = {"greedy": SamplingParams(temperature=0.0), "plain": SamplingParams(temperature=1.0),
                "top_p": SamplingParams(temperature=0.7, top_p=0.9)}
    counts = [b.sizes.num_logits for b in runner.buckets.all]
    logits = {n: jax.random.normal(jax.random.key(n), (n, runner.cfg.vocab_size)) for n in set(counts)}

    def run(name, n):
        tensors, k = runner.sampler_inputs.build([SamplingRow("probe", variants[name], [0], [], 0)], n)
        jax.block_until_ready(_sample_rows(logits[n], np.zeros(n, np.int32), tensors, num_logprobs=k))
        runner.sampler_inputs.free("probe")

    def seconds(calls):
        start = time.perf_counter()
        for name, n in calls:
            run(name, n)
        return round(time.perf_counter() - start, 1)

    first = {name: seconds([(name, n) for n in sorted(set(counts))]) for name in variants}
    before = seconds([(name, n) for n in counts for name in ("greedy", "top_p")])
    after = seconds([(name, n) for n in sorted(set(counts)) for name in ("plain", "top_p")])
    return {"vocab_size": runner.cfg.vocab_size, "step_shapes": len(counts), "logits_row_counts": len(set(counts)),
            "compile_and_first_run_s": first, "runs_before_s": before, "runs_now_s": after}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["serve", "generate", "sampler"])
    p.add_argument("--cache-dir", help="the compilation cache (default: a new temporary directory)")
    p.add_argument("--tokenizer", default="demo", choices=["demo", "qwen3.5"],
                   help="serve: the tiny demo checkpoint, or a tiny qwen3_5 checkpoint with Qwen3.5's tokenizer "
                        "(sampler: always the latter)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the work directory (checkpoint, cache, server logs)")
    args, extra = p.parse_known_args(argv)
    work = Path(tempfile.mkdtemp(prefix="qnext-startup-"))
    cache_dir = Path(args.cache_dir) if args.cache_dir else work / "jax"
    model = None
    if args.what == "sampler" or (args.what == "serve" and args.tokenizer == "qwen3.5"):
        from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

        model = str(write_tiny_checkpoint(work / "qwen3_5-real-vocab", "qwen3_5", tokenizer="qwen3.5"))
    print(f"cache: {cache_dir}; load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        if args.what == "sampler":
            print(json.dumps({**time_sampler_warm_up(model), "load_average": round(os.getloadavg()[0], 1)}))
        for run in range(1, args.runs + 1 if args.what != "sampler" else 1):
            if args.what == "serve":
                result = time_serve(cache_dir, model, work / f"server-{run}.log")
            else:
                result = time_generate(cache_dir, extra)
            print(json.dumps({"run": run, **result, "load_average": round(os.getloadavg()[0], 1)}), flush=True)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
