"""The bandwidth floor: the bytes a step must move through memory, over the rate this machine streams them.

Bytes are counted from the parameter specs and the cache layout. A decode step reads every weight matrix once
(whatever its batch), each row's KV of its context and its recurrent and conv state, and writes the new KV, state
and conv rows; activations are not counted (they stay in cache at decode sizes). They are the least a step must
move: the floor, not a model of what XLA does. The benchmark (scripts/bench.py) sets this floor beside the GEMM
floor (qnext/bench/flops.py over the measured GEMM rate) and holds each phase to the slower of the two.
"""
from __future__ import annotations

import time

import numpy as np

from qnext.config import ModelConfig
from qnext.model.cache_layout import cache_layout
from qnext.model.weights import ParamSpec, map_specs, param_specs


def weight_bytes(cfg: ModelConfig, dtype, rows: int) -> float:
    """Weight bytes one step over `rows` tokens reads: every matmul weight (lm_head included) once, `rows` rows of
    the embedding table, and of each expert stack the share of experts that `rows` tokens route to (expected
    distinct experts of num_experts_per_tok picks per token, uniform routing)."""
    total = 0.0

    def visit(path: tuple, spec: ParamSpec) -> None:
        nonlocal total
        size = float(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize
        if path[0] == "embed":
            total += size / spec.shape[0] * rows
        elif spec.axes[0] == "expert":
            e, k = cfg.num_experts, cfg.num_experts_per_tok
            total += size * (1 - (1 - k / e) ** rows)
        else:
            total += size

    map_specs(visit, param_specs(cfg, dtype))     # a tied lm_head is still read whole: the engine keeps it as a copy
    return total


def decode_step_bytes(cfg: ModelConfig, dtype, contexts: list[int]) -> float:
    """One decode step of len(contexts) rows, row i attending to contexts[i] tokens (its own included): weights,
    KV read (contexts) and written (one token a row), recurrent and conv state read and written."""
    layout = cache_layout(cfg, np.dtype(param_specs(cfg, dtype)["embed"].dtype))
    kv_per_token = layout.kv_bytes_per_block(1)
    return (weight_bytes(cfg, dtype, len(contexts)) + kv_per_token * (sum(contexts) + len(contexts))
            + 2 * layout.state_bytes_per_row * len(contexts))


def workload_bytes(cfg: ModelConfig, dtype, prompt_lens: list[int], output_len: int,
                   max_num_batched_tokens: int) -> dict[str, float]:
    """Prefill (the fewest steps the token budget allows, each reading the weights once; every prompt token's KV and
    each prompt's end state written) and decode (output_len - 1 steps of every row at once) bytes."""
    layout = cache_layout(cfg, np.dtype(param_specs(cfg, dtype)["embed"].dtype))
    tokens = sum(prompt_lens)
    steps = -(-tokens // max_num_batched_tokens)
    prefill = (steps * weight_bytes(cfg, dtype, min(tokens, max_num_batched_tokens))
               + layout.kv_bytes_per_block(1) * tokens + layout.state_bytes_per_row * len(prompt_lens))
    per_step = [decode_step_bytes(cfg, dtype, [n + j for n in prompt_lens]) for j in range(1, output_len)]
    return {"prefill": prefill, "decode": float(sum(per_step)), "decode_steps": output_len - 1,
            "decode_step_mean": float(np.mean(per_step)) if per_step else 0.0}


def memory_bandwidth(nbytes: int, reps: int = 5, reads: int = 8) -> dict:
    """Bytes/s this machine sustains: `reads` back-to-back reads of a float32 buffer of `nbytes` (the model's
    weights, so the small model's buffer is far bigger than the caches, and a tiny model's stays in them as its
    weights do), timed together (a decode pass sustains its rate too; this VM's single reads burst to 1.5x when its
    neighbours idle), by a few readers, each the fastest of `reps`; the fastest reader gives the rate (the bandwidth
    floor's denominator).
    Readers: jitted XLA sums over the buffer and over its two halves, numpy's BLAS matrix-vector product (its own
    threads) and the engine's own projection of one row (qnext.ops.linear: two matrix-vector products at once),
    so the rate hangs on no one library's threading. A reader only makes the floor stricter: the rate is the
    fastest any of them streams."""
    import jax
    import jax.numpy as jnp

    from qnext.ops.linear import linear

    n = max(nbytes // 4 // 4096, 1) * 4096
    host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    ones = np.ones(4096, np.float32)
    device = jnp.asarray(host)
    readers = {
        "xla sum": (jax.jit(jnp.sum), device),
        "xla sum of 2 halves": (jax.jit(lambda x: jnp.sum(x.reshape(2, -1), axis=1)), device),
        "qnext linear, 1 row": (jax.jit(lambda x: linear(jnp.ones((1, 4096), x.dtype), x.reshape(-1, 4096))), device),
        "numpy BLAS matvec": (lambda x: x.reshape(-1, 4096) @ ones, host),
    }
    seconds = {}
    for name, (read, x) in readers.items():
        jax.block_until_ready(read(x))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(reads):
                jax.block_until_ready(read(x))
            times.append((time.perf_counter() - t0) / reads)
        seconds[name] = min(times)
    time.sleep(0.2)     # OpenBLAS's threads spin a while after a call: what runs next on these cores would slow down
    best = min(seconds, key=seconds.get)
    return {"bytes": host.nbytes, "bytes_per_s": host.nbytes / seconds[best], "reader": best,
            "bytes_per_s_by_reader": {k: host.nbytes / v for k, v in seconds.items()}}


def floors(flops: dict, traffic: dict, rate_prefill: float, rate_decode: float, bandwidth: float) -> dict:
    """The workload's floors, per phase: GEMM (its matmul FLOPs at the GEMM rate of the phase's shapes) and bandwidth
    (its bytes at the machine's streaming rate). The binding floor takes the slower of the two in each phase
    (prefill is GEMM-bound, small-batch decode bandwidth-bound); decode_step_s is the binding floor of one decode
    step of every row."""
    gemm = {"prefill": flops["prefill"] / rate_prefill, "decode": flops["decode"] / rate_decode}
    band = {"prefill": traffic["prefill"] / bandwidth, "decode": traffic["decode"] / bandwidth}
    steps = max(traffic["decode_steps"], 1)
    return {"gemm_seconds": sum(gemm.values()), "bandwidth_seconds": sum(band.values()),
            "seconds": sum(max(gemm[p], band[p]) for p in gemm),
            "binding": {p: "gemm" if gemm[p] >= band[p] else "bandwidth" for p in gemm},
            "decode_step_gemm_s": gemm["decode"] / steps, "decode_step_bandwidth_s": band["decode"] / steps,
            "decode_step_s": max(gemm["decode"], band["decode"]) / steps}
