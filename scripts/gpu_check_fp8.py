"""gpu_check.py's FP8 rows (docs/fp8.md), measured on the first GPU run:

- fp8 KV pages: paged attention reading e4m3 pages (kv_cache_dtype fp8) against the reference on the same pages,
  decode and prefill, at each model's attention shape; the kernel of each backend (the Mosaic backend hands fp8 pages
  to the Triton kernel).
- the fp8 matmul (qnext/model/fp8_linear.py) at the largest dense projections of each model, at decode (16 rows)
  and prefill (2048 rows) sizes: "dequantize" and "scaled_dot" against the bf16 GEMM of the dequantised weights:
  max error, best time, and XLA's temporary bytes (a formulation that materialises the widened weight shows it
  here), so that the first GPU run says which formulation the engine should wire in.
"""
from __future__ import annotations

import functools

import numpy as np

ROWS = (16, 2048)
# (out, in) of each model's largest dense projection (HF layout [out, in])
DENSE = {"qwen3.5-27b": (34816, 5120), "qwen3-next-80b": (8192, 2048), "qwen3.5-397b": (16384, 4096)}
BLOCK = (128, 128)


def fp8_attention_cases(model, models, decode, prefill, block_size, d):
    """[(name, op, make_args, kwargs)] like gpu_check.kernel_cases, with the pages cast to e4m3."""
    import jax
    import jax.numpy as jnp

    import bench_kernels as bk
    import pallas_kernels as ops

    (hq, hkv), _ = models[model]

    def attention(seqs, kv_len, rows):
        def make():
            q, k, v, *rest = bk.attention_batch(jax.random.PRNGKey(0), seqs, kv_len, rows, hq, hkv, d, block_size,
                                                jnp.bfloat16)
            return (q, k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn), *rest)
        return make

    scale = dict(sm_scale=d ** -0.5)
    (n, kv_len), (seqs, prefill_len, c) = decode, prefill
    return [(f"paged_attention fp8-kv decode N={n} L=1 kv_len={kv_len}", ops.paged_attention,
             attention(n, kv_len, 1), scale),
            (f"paged_attention fp8-kv prefill N={seqs} L={c} kv_len={prefill_len}", ops.paged_attention,
             attention(seqs, prefill_len, c), scale)]


def fp8_matmul_rows(models, repeats, deadline, rows=ROWS, dense=DENSE):
    """One row per (model, rows, formulation): error vs the bf16 GEMM of the dequantised weight, time, temp bytes."""
    import time

    import jax
    import jax.numpy as jnp

    import bench_kernels as bk
    from qnext.model.fp8_blocks import quantize
    from qnext.model.fp8_linear import FORMULATIONS, dequantize_on_device, fp8_linear
    from qnext.ops.linear import linear

    out = []
    for model in models:
        n, k = dense[model]
        w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
        q, s = (jnp.asarray(a) for a in quantize(w, BLOCK))
        for m in rows:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
            reference = jax.jit(lambda x, q, s: linear(x, dequantize_on_device(q, s, BLOCK, jnp.bfloat16)))
            _, best_r, want = bk.timed(reference, x, q, s, repeats=repeats)
            want = np.asarray(want, np.float32)
            for formulation in FORMULATIONS:
                base = dict(model=model, kernel=f"fp8_linear {formulation} M={m} N={n} K={k}", backend="xla")
                if time.monotonic() > deadline:
                    out.append(dict(base, ok=None, skipped="time budget"))
                    continue
                try:
                    fn = jax.jit(functools.partial(fp8_linear, block_size=BLOCK, formulation=formulation))
                    analysis = fn.lower(x, q, s).compile().memory_analysis()
                    first, best, got = bk.timed(fn, x, q, s, repeats=repeats)
                except Exception as err:          # noqa: BLE001 - one failing formulation must not hide the other
                    out.append(dict(base, ok=False, error=f"{type(err).__name__}: {err}"))
                    continue
                err = float(np.max(np.abs(np.asarray(got, np.float32) - want)))
                scale = float(np.max(np.abs(want)))
                out.append(dict(base, ok=bool(np.isfinite(err)) and err <= 0.08 * scale,
                                outputs=[dict(max_abs_err=err, reference_max_abs=scale)], lowered_to="none",
                                kernel_ms=best * 1e3, xla_ms=best_r * 1e3, speedup=best_r / best,
                                kernel_compile_s=first, xla_compile_s=0.0,
                                temp_bytes=int(getattr(analysis, "temp_size_in_bytes", 0) or 0),
                                weight_bytes=int(q.size + 4 * s.size)))
    return out
