"""One-command check of qnext's GPU kernels on a machine with an NVIDIA GPU (Python and JAX with CUDA installed).

    python scripts/gpu_check.py                      # writes gpu_check.json; about 3-6 minutes on an H200
    python scripts/gpu_check.py --out report.json --no-bench
    python scripts/gpu_check.py --kernels chunk_gated_delta_rule --models qwen3-next-80b   # one op, one shape

1. Kernels: every Pallas kernel of both backends (Triton; Mosaic GPU where the device is Hopper, see
   pallas_kernels/backend_choice.py) against its jnp reference at the layer shapes of Qwen3.5-27B, Qwen3-Next-80B
   and Qwen3.5-397B (qwen-math.md: full attention Hq/Hkv 24/4, 16/2, 32/2 with D = 256; delta rule Hk/Hv 16/48,
   16/32, 16/64 with dk = dv = 128; conv over 2 Hk dk + Hv dv channels): max |kernel - reference| and pass/fail,
   the custom call each lowered to (a Mosaic call that fell back to the reference is reported, not hidden), and
   the best time of the kernel vs XLA's jnp path at the same shapes (bf16 inputs, float32 states).
2. scripts/bench.py's small model (real head dims) at batch 1 and 16, bfloat16, on the GPU (no transformers
   side, no chat workload), with the engine's automatic kernel backend. Its checkpoint and JAX compilation cache go
   to --bench-dir (default: a new folder in the temp dir, not next to the report); its JSON and its log (clipped)
   go next to the report: <report stem>_bench.json and <report stem>_bench.log.
3. FP8 rows (scripts/gpu_check_fp8.py): paged attention over e4m3 KV pages, and the fp8 matmul's two formulations
   against the bf16 GEMM of the dequantised weights (error, time, XLA's temporary bytes).
--kernels and --models run only some ops / model shapes (the bench still runs unless --no-bench).
The JSON report holds the environment (JAX version, device, compute capability, the automatic backend choice and
why), every kernel row and the bench's own JSON. A stage that would run past --budget-s is skipped and marked so.
Exit status: 0 all kernels match; 1 a kernel failed or mismatched; 2 no NVIDIA GPU visible to JAX.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MODELS = {  # name: ((Hq, Hkv), (Hk, Hv)); D = 256, dk = dv = 128, conv width 4
    "qwen3.5-27b": ((24, 4), (16, 48)),
    "qwen3-next-80b": ((16, 2), (16, 32)),
    "qwen3.5-397b": ((32, 2), (16, 64)),
}
D, DK, DV, C, BLOCK_SIZE, WIDTH = 256, 128, 128, 64, 16, 4
DECODE_ROWS, DECODE_KV_LEN = 32, 4096            # decode attention / recurrent delta rule / conv update rows
PREFILL_SEQS, PREFILL_KV_LEN = 8, 2048           # prefill attention: one 64-query group per sequence at its end
GDR_SEQS, GDR_LEN = 2, 1024                      # chunked delta rule: sequences x tokens (32 groups of 64)
TOLERANCE = dict(abs=2e-2, rel=2e-2)             # bf16 inputs; bf16 tensor-core operands with f32 accumulation


def gpu_device():
    """The first NVIDIA GPU JAX sees, or None."""
    import jax
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    cuda = [d for d in devices if getattr(d, "compute_capability", None) is not None]
    return cuda[0] if cuda else None


def kernel_cases(model):
    """[(name, op, make_args, kwargs)] at `model`'s layer shapes; make_args() builds the inputs (on the device)."""
    import jax
    import jax.numpy as jnp

    import bench_kernels as bk
    import pallas_kernels as ops

    (hq, hkv), (hk, hv) = MODELS[model]
    b, conv_dim = DECODE_ROWS, 2 * hk * DK + hv * DV
    bf16 = jnp.bfloat16

    def attention(seqs, kv_len, rows):
        return lambda: bk.attention_batch(jax.random.PRNGKey(0), seqs, kv_len, rows, hq, hkv, D, BLOCK_SIZE, bf16)

    def prefill_rows():
        r = bk.sequence_groups(GDR_SEQS, GDR_LEN, C)
        return r["length"], (r["read_row"], r["write_row"], r["capture_row"], r["is_first"], r["is_last"])

    def state_pool(key, rows):
        """[rows, Hv, dk, dv] random float32 states with row 0 the zero state, as in the engine's pools (the ops'
        contract: read_row -1 and 0 both mean a zero state; the kernels read -1 as zeros or read row 0)."""
        return (jax.random.normal(key, (rows, hv, DK, DV), jnp.float32) * 0.1).at[0].set(0.0)

    def chunk():
        length, (read, write, capture, first, last) = prefill_rows()
        # sequence 0 starts from the zero state, sequence 1 continues from the state in its own row (a prefix hit)
        read = jnp.where(write == GDR_SEQS, GDR_SEQS, read)
        q, k, v, g, beta = bk.gdr_tensors(jax.random.PRNGKey(1), (length.shape[0], C), hk, hv, DK, DV, bf16)
        return (q, k, v, g, beta, length, state_pool(jax.random.PRNGKey(2), GDR_SEQS + 1), read, write, capture,
                first, last)

    def decode_rows():
        return jnp.arange(1, b + 1, dtype=jnp.int32), jnp.zeros((b,), jnp.int32)

    def recurrent():
        live, none = decode_rows()
        q, k, v, g, beta = bk.gdr_tensors(jax.random.PRNGKey(3), (b,), hk, hv, DK, DV, bf16)
        return (q, k, v, g, beta, state_pool(jax.random.PRNGKey(4), b + 1), live, live, none)

    def weight():
        return jax.random.normal(jax.random.PRNGKey(5), (conv_dim, WIDTH), bf16)

    def conv_update():
        live, none = decode_rows()
        x = jax.random.normal(jax.random.PRNGKey(6), (b, conv_dim), bf16)
        conv_state = jax.random.normal(jax.random.PRNGKey(7), (b + 1, WIDTH - 1, conv_dim), bf16)
        return (x, weight(), conv_state, live, live, none)

    def conv_chunked():
        length, rows = prefill_rows()
        x = jax.random.normal(jax.random.PRNGKey(8), (length.shape[0], C, conv_dim), bf16)
        conv_state = jnp.zeros((GDR_SEQS + 1, WIDTH - 1, conv_dim), bf16)
        return (x, weight(), conv_state, length, *rows)

    scale = dict(sm_scale=D ** -0.5)
    return [
        (f"paged_attention decode N={b} L=1 kv_len={DECODE_KV_LEN}", ops.paged_attention,
         attention(b, DECODE_KV_LEN, 1), scale),
        (f"paged_attention prefill N={PREFILL_SEQS} L={C} kv_len={PREFILL_KV_LEN}", ops.paged_attention,
         attention(PREFILL_SEQS, PREFILL_KV_LEN, C), scale),
        (f"chunk_gated_delta_rule {GDR_SEQS}x{GDR_LEN} tokens", ops.chunk_gated_delta_rule, chunk, {}),
        (f"recurrent_gated_delta_rule N={b}", ops.recurrent_gated_delta_rule, recurrent, {}),
        (f"causal_conv1d_update N={b} D={conv_dim}", ops.causal_conv1d_update, conv_update, {}),
        (f"causal_conv1d_chunked {GDR_SEQS}x{GDR_LEN} tokens D={conv_dim}", ops.causal_conv1d_chunked, conv_chunked,
         {}),
    ]


def lowered_to(fn, args):
    """Which Pallas custom call a jitted function lowers to: "mosaic", "triton" or "none" (XLA only)."""
    import jax
    text = jax.jit(fn).lower(*args).as_text()
    if "mosaic_gpu" in text:
        return "mosaic"
    return "triton" if "xla.gpu.triton" in text else "none"


def time_reference(op, args, kwargs, repeats):
    """(first call incl. compile s, best s, outputs) of XLA's jnp path; shared by both backends' rows."""
    import functools

    import jax

    import bench_kernels as bk

    return bk.timed(jax.jit(functools.partial(op, implementation="reference", **kwargs)), *args, repeats=repeats)


def check_case(name, op, args, kwargs, backend, repeats, reference=None):
    """One kernel row: the kernel of `backend` against the reference (timed here unless given)."""
    import functools

    import jax
    import numpy as np

    import bench_kernels as bk

    kernel = functools.partial(op, implementation=backend, **kwargs)
    row = dict(kernel=name, backend=backend, lowered_to=lowered_to(kernel, args))
    first_k, best_k, out_k = bk.timed(jax.jit(kernel), *args, repeats=repeats)
    first_r, best_r, out_r = reference or time_reference(op, args, kwargs, repeats)
    errors, ok = [], True
    pools = name.startswith(("chunk", "recurrent", "causal"))
    for i, (got, want) in enumerate(zip(jax.tree.leaves(out_k), jax.tree.leaves(out_r))):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if pools and i == 1:
            got, want = got[1:], want[1:]                       # state pools: row 0 (the dummy) is undefined
        err, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
        errors.append(dict(max_abs_err=err, reference_max_abs=scale))
        ok &= bool(np.isfinite(err)) and err <= TOLERANCE["abs"] + TOLERANCE["rel"] * scale
    row.update(ok=ok, outputs=errors, kernel_ms=best_k * 1e3, xla_ms=best_r * 1e3, speedup=best_r / best_k,
               kernel_compile_s=first_k, xla_compile_s=first_r)
    return row


KERNELS = ("paged_attention", "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "causal_conv1d_update",
           "causal_conv1d_chunked", "fp8_linear")       # the op of a case is the first word of its name


def run_kernels(backends, repeats, deadline, models=tuple(MODELS), kernels=KERNELS):
    import gpu_check_fp8 as fp8

    rows = []
    for model in models:
        fp8_cases = fp8.fp8_attention_cases(model, MODELS, (DECODE_ROWS, DECODE_KV_LEN),
                                            (PREFILL_SEQS, PREFILL_KV_LEN, C), BLOCK_SIZE, D)
        for name, op, make_args, kwargs in kernel_cases(model) + fp8_cases:
            if name.split()[0] not in kernels:
                continue
            reference = args = None
            for backend in backends:
                base = dict(model=model, kernel=name, backend=backend)
                if time.monotonic() > deadline:
                    rows.append(dict(base, ok=None, skipped="time budget"))
                    continue
                try:
                    args = args or make_args()
                    reference = reference or time_reference(op, args, kwargs, repeats)
                    row = dict(model=model, **check_case(name, op, args, kwargs, backend, repeats, reference))
                except Exception as err:          # noqa: BLE001 - one broken kernel must not hide the others
                    row = dict(base, ok=False, error=f"{type(err).__name__}: {err}",
                               traceback=traceback.format_exc(limit=4))
                rows.append(row)
                print(_row_line(row), flush=True)
    if "fp8_linear" in kernels:
        for row in fp8.fp8_matmul_rows(models, repeats, deadline):
            rows.append(row)
            if "skipped" not in row:
                    print(_row_line(row) + (f"  temp {row['temp_bytes'] / 2**20:.0f} MiB (weight "
                                        f"{row['weight_bytes'] / 2**20:.0f} MiB)" if "temp_bytes" in row else ""),
                      flush=True)
    return rows


def _row_line(row):
    if "error" in row:
        return f"FAIL  {row['model']:15s} {row['backend']:7s} {row['kernel']}: {row['error'][:200]}"
    err = max(o["max_abs_err"] for o in row["outputs"])
    return (f"{'ok  ' if row['ok'] else 'BAD '}  {row['model']:15s} {row['backend']:7s} {row['kernel']:55s} "
            f"-> {row['lowered_to']:6s} err {err:.2e}  kernel {row['kernel_ms']:8.3f} ms  XLA {row['xla_ms']:8.3f} "
            f"ms  x{row['speedup']:.2f}")


LOG_LIMIT = 200_000          # characters of the bench's log kept (head and tail), so the report folder stays small


def _clipped(text, limit=LOG_LIMIT):
    if len(text) <= limit:
        return text
    return f"{text[:limit // 4]}\n... [{len(text) - limit} characters left out] ...\n{text[-3 * limit // 4:]}"


def _text(x):
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def run_bench(report_path, work_dir, timeout_s, batches="1,16", repeats=2):
    """scripts/bench.py's small model at `batches` (bf16, no transformers, no chat) -> its JSON or an error.
    Checkpoints and the compilation cache go under `work_dir`; the bench's JSON and log next to the report."""
    stem = report_path.with_suffix("")
    json_out, log_out = Path(f"{stem}_bench.json"), Path(f"{stem}_bench.log")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--models", "small", "--dtype", "bfloat16",
           "--batches", f"small:{batches}", "--no-hf", "--chat-models=", "--repeats", str(repeats), "--out-dir",
           str(work_dir), "--json-out", str(json_out)]
    if timeout_s < 60:
        return dict(skipped="time budget", command=" ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        stdout, stderr, code = _text(err.stdout), _text(err.stderr), None
    log_out.write_text(_clipped(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"))
    result = dict(command=" ".join(cmd), returncode=code, log=str(log_out), stdout_tail=stdout[-4000:],
                  stderr_tail=stderr[-6000:],
                  # an out-of-memory error's own lines (the allocator's summary after it pushes them out of the tail)
                  oom_lines=[line[:500] for line in stderr.splitlines() if "out of memory" in line.lower()][:10])
    if code is None:
        result["error"] = f"timed out after {timeout_s:.0f} s"
    elif code == 0 and json_out.exists():
        result["report"] = json.loads(json_out.read_text())
    return result


def _choice(text, allowed, what):
    chosen = [x for x in text.split(",") if x]
    unknown = [x for x in chosen if x not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"gpu_check: {what} must be a comma list of {', '.join(allowed)}; got {text!r}")
    return chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report")
    p.add_argument("--backends", default="triton,mosaic", help="comma list of triton, mosaic")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per kernel (best is reported)")
    p.add_argument("--budget-s", type=float, default=450.0, help="wall budget of the whole check, seconds")
    p.add_argument("--no-bench", action="store_true", help="skip bench.py")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of ops to check, of {', '.join(KERNELS)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of model shapes, of {', '.join(MODELS)}")
    p.add_argument("--bench-batches", default="1,16", help="bench.py's batch sizes for the small model")
    p.add_argument("--bench-repeats", type=int, default=2, help="bench.py's timed passes per engine")
    p.add_argument("--bench-dir", type=Path, default=None,
                   help="bench.py's checkpoints and compilation cache (default: a new folder in the temp dir)")
    args = p.parse_args(argv)
    kernels = _choice(args.kernels, KERNELS, "--kernels")
    models = _choice(args.models, tuple(MODELS), "--models")
    start = time.monotonic()

    device = gpu_device()
    if device is None:
        import jax
        print(f"gpu_check: no NVIDIA GPU visible to JAX {jax.__version__} (backend {jax.default_backend()!r}, "
              f"devices {[d.device_kind for d in jax.devices()]}). Run this on a machine with an NVIDIA GPU and "
              f"JAX's CUDA plugin: pip install -U \"jax[cuda12]\" (or jax[cuda13]).", file=sys.stderr)
        return 2

    import jax

    from pallas_kernels import backend_choice

    capability = str(device.compute_capability)
    auto, reason = backend_choice.choose_gpu_kernel_backend(jax.__version__, capability)
    backends = [b for b in args.backends.split(",") if b]
    skipped = {}
    if "mosaic" in backends and not backend_choice.parse_capability(capability)[0] == 9:
        backends.remove("mosaic")
        skipped["mosaic"] = f"device sm_{capability.replace('.', '')} is not Hopper (the kernels use wgmma)"
    env = dict(jax=jax.__version__, device=device.device_kind, compute_capability=capability,
               auto_backend=auto, auto_reason=reason, backends=backends, skipped_backends=skipped,
               python=sys.version.split()[0])
    print(f"gpu_check: JAX {env['jax']} on {env['device']} (sm {capability}); auto backend: {auto} ({reason})")
    deadline = start + args.budget_s * (0.6 if not args.no_bench else 1.0)
    rows = run_kernels(backends, args.repeats, deadline, models, kernels)
    report = dict(env=env, kernels=rows, tolerance=TOLERANCE, selected=dict(kernels=kernels, models=models))
    if not args.no_bench:
        work_dir = args.bench_dir or Path(tempfile.mkdtemp(prefix="qnext_gpu_check_bench_"))
        bench = run_bench(args.out.resolve(), work_dir, start + args.budget_s - time.monotonic(), args.bench_batches,
                          args.bench_repeats)
        report["bench"] = bench
        print(f"gpu_check: bench {'ok' if 'report' in bench else 'FAILED'} (exit {bench.get('returncode')}); "
              f"log in {bench.get('log')}" + "".join(f"\n  {line}" for line in bench.get("oom_lines", [])[:2]))
    report["wall_s"] = time.monotonic() - start
    args.out.write_text(json.dumps(report, indent=2, default=str))
    bad = [r for r in rows if r.get("ok") is False]
    print(f"gpu_check: {len(rows) - len(bad)} of {len(rows)} kernel rows ok; report in {args.out} "
          f"({report['wall_s']:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
