"""Kernel micro-benchmark (a benchmark, not a test).

CPU (default): the pure-jnp chunked gated delta rule vs the token-by-token scan, and the paged-attention reference
vs dense attention over the gathered KV, side by side.
GPU (--gpu): every Pallas kernel (--backend: the device's automatic choice, triton or mosaic) vs its reference at the model shapes, with the achieved bandwidth
(minimum bytes each op must move / best time) against the H200's 4.8 TB/s, and the max |kernel - reference|.

    python scripts/bench_kernels.py                       # CPU tables
    python scripts/bench_kernels.py --json bench.json     # also write the rows as JSON
    python scripts/bench_kernels.py --gpu                 # on a GPU host
    python scripts/bench_kernels.py --gpu --backend mosaic   # Mosaic GPU kernels (Hopper); scripts/gpu_check.py
                                                             # checks both backends at three model sizes
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as ops  # noqa: E402

gdr = importlib.import_module("pallas_kernels.gated_delta_rule")
attn = importlib.import_module("pallas_kernels.paged_attention")

H200_BANDWIDTH = 4.8e12  # bytes/s


def timed(fn, *args, repeats):
    """(first call incl. compile, best of `repeats` later calls) in seconds; fn is jitted by the caller.
    Best-of rather than median: on a shared CPU the median mostly measures the neighbours."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, min(times), out


# ----------------------------------------------------------------------------------------------------- inputs
def sequence_groups(num_seqs, seq_len, c):
    """Row arrays for num_seqs fresh sequences of seq_len tokens, cut into groups of c (prefill view)."""
    per_seq = -(-seq_len // c)
    n = num_seqs * per_seq
    idx = np.arange(n)
    length = np.minimum(c, seq_len - (idx % per_seq) * c).astype(np.int32)
    seq = idx // per_seq
    return dict(length=jnp.asarray(length), read_row=jnp.full((n,), -1, jnp.int32),
                write_row=jnp.asarray(seq + 1, jnp.int32), capture_row=jnp.zeros((n,), jnp.int32),
                is_first=jnp.asarray(idx % per_seq == 0), is_last=jnp.asarray(idx % per_seq == per_seq - 1))


def gdr_tensors(key, lead, hk, hv, dk, dv, dtype):
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = (unit(jax.random.normal(kq, lead + (hk, dk))) * dk ** -0.5).astype(dtype)
    k = unit(jax.random.normal(kk, lead + (hk, dk))).astype(dtype)
    v = jax.random.normal(kv, lead + (hv, dv)).astype(dtype)
    g = -jax.random.uniform(kg, lead + (hv,), minval=0.01, maxval=0.4)
    beta = jax.random.uniform(kb, lead + (hv,), minval=0.05, maxval=0.95)
    return q, k, v, g, beta


def attention_batch(key, num_seqs, kv_len, group_len, hq, hkv, d, block_size, dtype):
    """num_seqs sequences of kv_len tokens whose last group_len tokens are the queries (one group each)."""
    mb = -(-kv_len // block_size)
    kq, kk, kv, kp = jax.random.split(key, 4)
    num_blocks = num_seqs * mb + 1
    table = (jax.random.permutation(kp, num_blocks - 1)[:num_seqs * mb] + 1).reshape(num_seqs, mb).astype(jnp.int32)
    q = jax.random.normal(kq, (num_seqs, group_len, hq, d)).astype(dtype)
    k_pages = jax.random.normal(kk, (hkv, num_blocks, block_size, d)).astype(dtype)
    v_pages = jax.random.normal(kv, (hkv, num_blocks, block_size, d)).astype(dtype)
    kv_lens = jnp.full((num_seqs,), kv_len, jnp.int32)
    q_pos = jnp.broadcast_to(kv_len - group_len + jnp.arange(group_len, dtype=jnp.int32), (num_seqs, group_len))
    return q, k_pages, v_pages, table, kv_lens, q_pos


def dense_gathered_attention(q, k_pages, v_pages, block_table, kv_len, q_pos, *, sm_scale):
    """Gather each group's whole KV [N, MB*bs, Hkv, D] and run one masked softmax (the O(N * max_len) baseline)."""
    n, length, hq, d = q.shape
    hkv = k_pages.shape[0]
    k = jnp.moveaxis(k_pages[:, block_table], 0, 3).reshape(n, -1, hkv, d).astype(jnp.float32)
    v = jnp.moveaxis(v_pages[:, block_table], 0, 3).reshape(n, -1, hkv, d).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(n, length, hkv, hq // hkv, d) * sm_scale
    s = jnp.einsum("nlhgd,nkhd->nlhgk", qg, k)
    key_pos = jnp.arange(k.shape[1])
    visible = (key_pos[None, None] < kv_len[:, None, None]) & (key_pos[None, None] <= q_pos[:, :, None])
    s = jnp.where(visible[:, :, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("nlhgk,nkhd->nlhgd", p, v).reshape(n, length, hq, d)


# ------------------------------------------------------------------------------------------------------ CPU
def bench_cpu_gdr(tokens, hv, hk, dk, dv, c, repeats):
    rows = []
    for t in tokens:
        q, k, v, g, beta = gdr_tensors(jax.random.PRNGKey(t), (t,), hk, hv, dk, dv, jnp.float32)
        state = jnp.zeros((2, hv, dk, dv), jnp.float32)
        r = sequence_groups(1, t, c)

        def to_groups(x):
            return x.reshape((t // c, c) + x.shape[1:])

        chunked = jax.jit(lambda q, k, v, g, beta, state: gdr.chunk_gated_delta_rule_reference(
            q, k, v, g, beta, r["length"], state, r["read_row"], r["write_row"], r["capture_row"], r["is_first"],
            r["is_last"]))
        scan = jax.jit(gdr.gated_delta_rule_token_scan)
        first_c, med_c, (o_c, s_c) = timed(chunked, *map(to_groups, (q, k, v, g, beta)), state, repeats=repeats)
        first_s, med_s, (o_s, s_s) = timed(scan, q, k, v, g, beta, repeats=repeats)
        err = float(jnp.max(jnp.abs(o_c.reshape(o_s.shape) - o_s)))
        rows.append(dict(op="gated delta rule", shape=f"T={t} Hv={hv} Hk={hk} dk={dk} dv={dv} C={c}",
                         candidate="chunked reference", baseline="token scan", candidate_ms=med_c * 1e3,
                         baseline_ms=med_s * 1e3, candidate_compile_s=first_c, baseline_compile_s=first_s,
                         speedup=med_s / med_c, max_abs_diff=err))
    return rows


def bench_cpu_attention(cases, hq, hkv, d, block_size, repeats):
    rows = []
    for name, num_seqs, kv_len, group_len in cases:
        args = attention_batch(jax.random.PRNGKey(kv_len), num_seqs, kv_len, group_len, hq, hkv, d, block_size,
                               jnp.bfloat16)
        ref = jax.jit(lambda *a: attn.paged_attention_reference(*a, sm_scale=d ** -0.5))
        dense = jax.jit(lambda *a: dense_gathered_attention(*a, sm_scale=d ** -0.5))
        first_r, med_r, out_r = timed(ref, *args, repeats=repeats)
        first_d, med_d, out_d = timed(dense, *args, repeats=repeats)
        rows.append(dict(op=f"paged attention ({name})",
                         shape=f"N={num_seqs} L={group_len} kv_len={kv_len} Hq={hq} Hkv={hkv} D={d} bs={block_size}",
                         candidate="reference (paged online softmax)", baseline="dense over gathered KV",
                         candidate_ms=med_r * 1e3, baseline_ms=med_d * 1e3, candidate_compile_s=first_r,
                         baseline_compile_s=first_d, speedup=med_d / med_r,
                         max_abs_diff=float(jnp.max(jnp.abs(out_r - out_d)))))
    return rows


# ------------------------------------------------------------------------------------------------------ GPU
def _gpu_row(name, shape, kernel, reference, args, num_bytes, repeats, label="pallas"):
    first_k, med_k, out_k = timed(jax.jit(kernel), *args, repeats=repeats)
    first_r, med_r, out_r = timed(jax.jit(reference), *args, repeats=repeats)
    out_k, out_r = jax.tree.leaves(out_k)[0], jax.tree.leaves(out_r)[0]
    bandwidth = num_bytes / med_k
    return dict(op=name, shape=shape, candidate=label, baseline="reference (XLA)",
                candidate_ms=med_k * 1e3, baseline_ms=med_r * 1e3, candidate_compile_s=first_k,
                baseline_compile_s=first_r, speedup=med_r / med_k,
                max_abs_diff=float(jnp.max(jnp.abs(out_k.astype(jnp.float32) - out_r.astype(jnp.float32)))),
                bytes=num_bytes, tb_per_s=bandwidth / 1e12, fraction_of_peak=bandwidth / H200_BANDWIDTH)


@dataclasses.dataclass(frozen=True)
class GpuShapes:
    """Model shapes: full attention Hq=16 Hkv=2 D=256 bf16 pages; linear attention Hk=16 Hv=32 dk=dv=128; conv
    8192 channels. attention: (name, sequences, kv_len, query rows per group)."""
    hq: int = 16
    hkv: int = 2
    d: int = 256
    block_size: int = 16
    attention: tuple = (("decode", 64, 4096, 1), ("prefill", 16, 4096, 64))
    hk: int = 16
    hv: int = 32
    dk: int = 128
    dv: int = 128
    c: int = 64
    num_seqs: int = 4          # prefill sequences for the chunked delta rule / conv
    seq_len: int = 2048
    batch: int = 64            # decode rows for the recurrent delta rule / conv update
    width: int = 4


def bench_gpu(repeats, shapes=GpuShapes(), interpret=False, backend="pallas"):
    """Pallas kernels (backend: "pallas" = the device's choice, "triton", "mosaic") vs references. `interpret` only
    exists to smoke-test this path on a CPU with tiny shapes."""
    x_ = shapes
    rows = []
    label = f"pallas ({backend})"

    def pair(op, **kw):
        return (lambda *a: op(*a, implementation=backend, interpret=interpret, **kw),
                lambda *a: op(*a, implementation="reference", **kw))

    for name, num_seqs, kv_len, group_len in x_.attention:
        args = attention_batch(jax.random.PRNGKey(0), num_seqs, kv_len, group_len, x_.hq, x_.hkv, x_.d,
                               x_.block_size, jnp.bfloat16)
        kv_bytes = num_seqs * kv_len * x_.hkv * x_.d * 2 * 2
        io_bytes = num_seqs * group_len * x_.hq * x_.d * (2 + 4)
        rows.append(_gpu_row(
            f"paged attention ({name})",
            f"N={num_seqs} L={group_len} kv_len={kv_len} Hq={x_.hq} Hkv={x_.hkv} D={x_.d} bs={x_.block_size}",
            *pair(ops.paged_attention, sm_scale=x_.d ** -0.5), args, kv_bytes + io_bytes, repeats, label))

    state_bytes = x_.hv * x_.dk * x_.dv * 4
    r = sequence_groups(x_.num_seqs, x_.seq_len, x_.c)
    n = r["length"].shape[0]
    row_args = (r["read_row"], r["write_row"], r["capture_row"], r["is_first"], r["is_last"])
    q, k, v, g, beta = gdr_tensors(jax.random.PRNGKey(1), (n, x_.c), x_.hk, x_.hv, x_.dk, x_.dv, jnp.bfloat16)
    state = jnp.zeros((x_.num_seqs + 1, x_.hv, x_.dk, x_.dv), jnp.float32)
    tokens = x_.num_seqs * x_.seq_len
    gdr_bytes = (tokens * (2 * x_.hk * x_.dk * 2 + x_.hv * x_.dv * (2 + 4) + 2 * x_.hv * 4)
                 + x_.num_seqs * state_bytes)
    kernel, reference = pair(ops.chunk_gated_delta_rule)
    rows.append(_gpu_row(
        "chunk gated delta rule",
        f"{x_.num_seqs}x{x_.seq_len} tokens Hk={x_.hk} Hv={x_.hv} dk={x_.dk} dv={x_.dv} C={x_.c} bf16",
        lambda q, k, v, g, beta, s: kernel(q, k, v, g, beta, r["length"], s, *row_args),
        lambda q, k, v, g, beta, s: reference(q, k, v, g, beta, r["length"], s, *row_args),
        (q, k, v, g, beta, state), gdr_bytes, repeats, label))

    b = x_.batch
    q, k, v, g, beta = gdr_tensors(jax.random.PRNGKey(2), (b,), x_.hk, x_.hv, x_.dk, x_.dv, jnp.bfloat16)
    state = jax.random.normal(jax.random.PRNGKey(3), (b + 1, x_.hv, x_.dk, x_.dv), jnp.float32)
    live = jnp.arange(1, b + 1, dtype=jnp.int32)
    no_capture = jnp.zeros((b,), jnp.int32)
    rec_bytes = b * (2 * state_bytes + 2 * x_.hk * x_.dk * 2 + x_.hv * x_.dv * (2 + 4) + 2 * x_.hv * 4)
    kernel, reference = pair(ops.recurrent_gated_delta_rule)
    rows.append(_gpu_row(
        "recurrent gated delta rule", f"N={b} Hk={x_.hk} Hv={x_.hv} dk={x_.dk} dv={x_.dv}",
        lambda *a: kernel(*a, live, live, no_capture), lambda *a: reference(*a, live, live, no_capture),
        (q, k, v, g, beta, state), rec_bytes, repeats, label))

    conv_dim, width = 2 * x_.hk * x_.dk + x_.hv * x_.dv, x_.width
    x = jax.random.normal(jax.random.PRNGKey(4), (n, x_.c, conv_dim), jnp.bfloat16)
    weight = jax.random.normal(jax.random.PRNGKey(5), (conv_dim, width), jnp.bfloat16)
    conv_state = jnp.zeros((x_.num_seqs + 1, width - 1, conv_dim), jnp.bfloat16)
    conv_bytes = 2 * tokens * conv_dim * 2 + x_.num_seqs * (width - 1) * conv_dim * 2
    kernel, reference = pair(ops.causal_conv1d_chunked)
    rows.append(_gpu_row(
        "causal conv1d chunked", f"{x_.num_seqs}x{x_.seq_len} tokens D={conv_dim} K={width} bf16",
        lambda x, w, s: kernel(x, w, s, r["length"], *row_args),
        lambda x, w, s: reference(x, w, s, r["length"], *row_args),
        (x, weight, conv_state), conv_bytes, repeats, label))

    x = jax.random.normal(jax.random.PRNGKey(6), (b, conv_dim), jnp.bfloat16)
    conv_state = jax.random.normal(jax.random.PRNGKey(7), (b + 1, width - 1, conv_dim), jnp.bfloat16)
    upd_bytes = b * conv_dim * 2 * (2 + 2 * (width - 1))
    kernel, reference = pair(ops.causal_conv1d_update)
    rows.append(_gpu_row(
        "causal conv1d update", f"N={b} D={conv_dim} K={width} bf16",
        lambda x, w, s: kernel(x, w, s, live, live, no_capture),
        lambda x, w, s: reference(x, w, s, live, live, no_capture),
        (x, weight, conv_state), upd_bytes, repeats, label))
    return rows


# --------------------------------------------------------------------------------------------------- output
def print_table(rows):
    gpu = "tb_per_s" in rows[0]
    head = ["op", "shape", "candidate", "best ms", "baseline", "best ms", "speed-up", "max |diff|"]
    if gpu:
        head += ["TB/s", "% of 4.8 TB/s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["op"], r["shape"], r["candidate"], f"{r['candidate_ms']:.2f}", r["baseline"],
                 f"{r['baseline_ms']:.2f}", f"{r['speedup']:.1f}x", f"{r['max_abs_diff']:.1e}"]
        if gpu:
            cells += [f"{r['tb_per_s']:.2f}", f"{100 * r['fraction_of_peak']:.0f}%"]
        print("| " + " | ".join(cells) + " |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="time the Pallas kernels vs the references on a GPU")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="CPU delta-rule sequence lengths")
    p.add_argument("--value-heads", type=int, default=16)
    p.add_argument("--key-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64, help="CPU delta-rule dk = dv")
    p.add_argument("--backend", default="pallas", choices=("pallas", "triton", "mosaic"),
                   help="--gpu kernels: pallas = the device's automatic choice (pallas_kernels/backend_choice.py)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the result rows to this file")
    args = p.parse_args(argv)

    if args.gpu:
        if jax.default_backend() != "gpu":
            p.error(f"--gpu needs a GPU backend; jax sees {jax.default_backend()!r}")
        rows = bench_gpu(args.repeats, backend=args.backend)
    else:
        rows = bench_cpu_gdr(args.tokens, args.value_heads, args.key_heads, args.head_dim, args.head_dim, 64,
                             args.repeats)
        rows += bench_cpu_attention([("decode", 16, 4096, 1), ("prefill", 4, 4096, 64)], hq=16, hkv=2, d=256,
                                    block_size=16, repeats=args.repeats)
    device = jax.devices()[0]
    host = platform.processor() or platform.machine()
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind}), {host}, {os.cpu_count()} CPUs")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(dict(jax=jax.__version__, device=device.device_kind, rows=rows), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
