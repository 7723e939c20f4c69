"""The GEMM rate this machine reaches at a model's own matmul shapes: the compute half of the benchmarks' floors
(qnext/bench/bandwidth.py has the memory half)."""
from __future__ import annotations

import time

from qnext.bench.flops import matmul_shapes


def gemm_rates(cfg, ms: list[int], dtypes: tuple[str, ...], reps: int = 3) -> dict[int, dict[str, dict]]:
    """{m: {dtype: result}}: seconds and FLOP/s of x [m, K] times every weight matrix of the model (distinct weights,
    so weight traffic is real), in `dtype` with float32 accumulation, jitted, the fastest of `reps` (the rate the
    machine reaches when a neighbour does not slow it: the strictest floor), for both weight
    layouts: [K, N] (x @ W) and [N, K] (the engine's, qnext.ops.linear). The faster one is the machine's rate
    (`flops_per_s`). Each layout's weights are made once per dtype and timed at every m."""
    import jax
    import jax.numpy as jnp

    from qnext.ops.linear import linear

    shapes = matmul_shapes(cfg)
    key = jax.random.PRNGKey(0)
    layouts = {
        "x@W[K,N]": ([(k, n) for k, n in shapes],
                     lambda xs, ws: [jnp.dot(xs[w.shape[0]], w, preferred_element_type=jnp.float32) for w in ws]),
        "linear W[N,K]": ([(n, k) for k, n in shapes],
                          lambda xs, ws: [linear(xs[w.shape[1]], w, preferred_element_type=jnp.float32) for w in ws]),
    }
    seconds = {(m, dtype): {} for m in ms for dtype in dtypes}
    for dtype in dtypes:
        dt = jnp.dtype(dtype)
        for name, (weight_shapes, fn) in layouts.items():
            ws = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dt)
                  for i, s in enumerate(weight_shapes)]
            run = jax.jit(fn)
            for m in ms:
                xs = {k: jax.random.normal(key, (m, k), jnp.float32).astype(dt) for k in {k for k, _ in shapes}}
                jax.block_until_ready(run(xs, ws))
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(run(xs, ws))
                    times.append(time.perf_counter() - t0)
                seconds[m, dtype][name] = min(times)
            del ws
    out: dict[int, dict[str, dict]] = {m: {} for m in ms}
    for (m, dtype), by_layout in seconds.items():
        flops = sum(2 * m * k * n for k, n in shapes)
        sec = min(by_layout.values())
        out[m][dtype] = {"m": m, "dtype": dtype, "seconds": sec, "flops": flops, "flops_per_s": flops / sec,
                         "seconds_by_layout": by_layout}
    return out
