"""Kernel micro-benchmark (a benchmark, not a test).

CPU (default): the pure-jnp chunked gated delta rule vs the token-by-token scan, and the paged-attention reference
vs dense attention over the gathered KV, side by side.
GPU (--gpu): every Pallas kernel (Triton backend) vs its reference at the model shapes, with the achieved bandwidth
(minimum bytes each op must move / best time) against the H200's 4.8 TB/s, and the max |kernel - reference|.

    python scripts/bench_kernels.py                       # CPU tables
    python scripts/bench_kernels.py --json bench.json     # also write the rows as JSON
    python scripts/bench_kernels.py --gpu                 # on a GPU host
"""
from __future__ import annotations

import argparse
import importlib
import json
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
    k_pages = jax.random.normal(kk, (num_blocks, block_size, hkv, d)).astype(dtype)
    v_pages = jax.random.normal(kv, (num_blocks, block_size, hkv, d)).astype(dtype)
    kv_lens = jnp.full((num_seqs,), kv_len, jnp.int32)
    q_pos = jnp.broadcast_to(kv_len - group_len + jnp.arange(group_len, dtype=jnp.int32), (num_seqs, group_len))
    return q, k_pages, v_pages, table, kv_lens, q_pos


def dense_gathered_attention(q, k_pages, v_pages, block_table, kv_len, q_pos, *, sm_scale):
    """Gather each group's whole KV [N, MB*bs, Hkv, D] and run one masked softmax (the O(N * max_len) baseline)."""
    n, length, hq, d = q.shape
    hkv = k_pages.shape[2]
    k = k_pages[block_table].reshape(n, -1, hkv, d).astype(jnp.float32)
    v = v_pages[block_table].reshape(n, -1, hkv, d).astype(jnp.float32)
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
def _gpu_row(name, shape, kernel, reference, args, num_bytes, repeats):
    first_k, med_k, out_k = timed(jax.jit(kernel), *args, repeats=repeats)
    first_r, med_r, out_r = timed(jax.jit(reference), *args, repeats=repeats)
    out_k, out_r = jax.tree.leaves(out_k)[0], jax.tree.leaves(out_r)[0]
    bandwidth = num_bytes / med_k
    return dict(op=name, shape=shape, candidate="pallas (triton)", baseline="reference (XLA)",
                candidate_ms=med_k * 1e3, baseline_ms=med_r * 1e3, candidate_compile_s=first_k,
                baseline_compile_s=first_r, speedup=med_r / med_k,
                max_abs_diff=float(jnp.max(jnp.abs(out_k.astype(jnp.float32) - out_r.astype(jnp.float32)))),
                bytes=num_bytes, tb_per_s=bandwidth / 1e12, fraction_of_peak=bandwidth / H200_BANDWIDTH)


def bench_gpu(repeats):
    """Model shapes: full attention Hq=16 Hkv=2 D=256 bf16; linear attention Hk=16 Hv=32 dk=dv=128; conv 8192."""
    rows = []
    hq, hkv, d, bs = 16, 2, 256, 16
    for name, num_seqs, kv_len, group_len in (("decode", 64, 4096, 1), ("prefill", 16, 4096, 64)):
        args = attention_batch(jax.random.PRNGKey(0), num_seqs, kv_len, group_len, hq, hkv, d, bs, jnp.bfloat16)
        kv_bytes = num_seqs * kv_len * hkv * d * 2 * 2
        io_bytes = num_seqs * group_len * hq * d * (2 + 4)
        rows.append(_gpu_row(
            f"paged attention ({name})", f"N={num_seqs} L={group_len} kv_len={kv_len} Hq={hq} Hkv={hkv} D={d}",
            lambda *a: ops.paged_attention(*a, sm_scale=d ** -0.5, implementation="pallas"),
            lambda *a: ops.paged_attention(*a, sm_scale=d ** -0.5, implementation="reference"),
            args, kv_bytes + io_bytes, repeats))

    hk, hv, dk, dv, c = 16, 32, 128, 128, 64
    state_bytes = hv * dk * dv * 4
    num_seqs, seq_len = 4, 2048
    r = sequence_groups(num_seqs, seq_len, c)
    n = num_seqs * seq_len // c
    q, k, v, g, beta = gdr_tensors(jax.random.PRNGKey(1), (n, c), hk, hv, dk, dv, jnp.bfloat16)
    state = jnp.zeros((num_seqs + 1, hv, dk, dv), jnp.float32)
    row_args = (r["read_row"], r["write_row"], r["capture_row"], r["is_first"], r["is_last"])
    tokens = n * c
    gdr_bytes = tokens * (2 * hk * dk * 2 + hv * dv * 2 + 2 * hv * 4 + hv * dv * 4) + 2 * num_seqs * state_bytes
    rows.append(_gpu_row(
        "chunk gated delta rule", f"{num_seqs}x{seq_len} tokens Hk={hk} Hv={hv} dk={dk} dv={dv} C={c} bf16",
        lambda q, k, v, g, beta, s: ops.chunk_gated_delta_rule(q, k, v, g, beta, r["length"], s, *row_args,
                                                               implementation="pallas"),
        lambda q, k, v, g, beta, s: ops.chunk_gated_delta_rule(q, k, v, g, beta, r["length"], s, *row_args,
                                                               implementation="reference"),
        (q, k, v, g, beta, state), gdr_bytes, repeats))

    batch = 64
    q, k, v, g, beta = gdr_tensors(jax.random.PRNGKey(2), (batch,), hk, hv, dk, dv, jnp.bfloat16)
    state = jax.random.normal(jax.random.PRNGKey(3), (batch + 1, hv, dk, dv), jnp.float32)
    live = jnp.arange(1, batch + 1, dtype=jnp.int32)
    no_capture = jnp.zeros((batch,), jnp.int32)
    rec_bytes = batch * (2 * state_bytes + 2 * hk * dk * 2 + hv * dv * (2 + 4) + 2 * hv * 4)
    rows.append(_gpu_row(
        "recurrent gated delta rule", f"N={batch} Hk={hk} Hv={hv} dk={dk} dv={dv}",
        lambda *a: ops.recurrent_gated_delta_rule(*a, live, live, no_capture, implementation="pallas"),
        lambda *a: ops.recurrent_gated_delta_rule(*a, live, live, no_capture, implementation="reference"),
        (q, k, v, g, beta, state), rec_bytes, repeats))

    conv_dim, width = 2 * hk * dk + hv * dv, 4
    x = jax.random.normal(jax.random.PRNGKey(4), (n, c, conv_dim), jnp.bfloat16)
    weight = jax.random.normal(jax.random.PRNGKey(5), (conv_dim, width), jnp.bfloat16)
    conv_state = jnp.zeros((num_seqs + 1, width - 1, conv_dim), jnp.bfloat16)
    conv_bytes = 2 * n * c * conv_dim * 2 + 2 * num_seqs * (width - 1) * conv_dim * 2
    rows.append(_gpu_row(
        "causal conv1d chunked", f"{num_seqs}x{seq_len} tokens D={conv_dim} K={width} bf16",
        lambda x, w, s: ops.causal_conv1d_chunked(x, w, s, r["length"], *row_args, implementation="pallas"),
        lambda x, w, s: ops.causal_conv1d_chunked(x, w, s, r["length"], *row_args, implementation="reference"),
        (x, weight, conv_state), conv_bytes, repeats))

    x = jax.random.normal(jax.random.PRNGKey(6), (batch, conv_dim), jnp.bfloat16)
    conv_state = jax.random.normal(jax.random.PRNGKey(7), (batch + 1, width - 1, conv_dim), jnp.bfloat16)
    upd_bytes = batch * conv_dim * 2 * (2 + 2 * (width - 1))
    rows.append(_gpu_row(
        "causal conv1d update", f"N={batch} D={conv_dim} K={width} bf16",
        lambda x, w, s: ops.causal_conv1d_update(x, w, s, live, live, no_capture, implementation="pallas"),
        lambda x, w, s: ops.causal_conv1d_update(x, w, s, live, live, no_capture, implementation="reference"),
        (x, weight, conv_state), upd_bytes, repeats))
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
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the result rows to this file")
    args = p.parse_args(argv)

    if args.gpu:
        if jax.default_backend() != "gpu":
            p.error(f"--gpu needs a GPU backend; jax sees {jax.default_backend()!r}")
        rows = bench_gpu(args.repeats)
    else:
        rows = bench_cpu_gdr(args.tokens, args.value_heads, args.key_heads, args.head_dim, args.head_dim, 64,
                             args.repeats)
        rows += bench_cpu_attention([("decode", 16, 4096, 1), ("prefill", 4, 4096, 64)], hq=16, hkv=2, d=256,
                                    block_size=16, repeats=args.repeats)
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind}), {platform.processor() or platform.machine()}")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(dict(jax=jax.__version__, device=device.device_kind, rows=rows), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
