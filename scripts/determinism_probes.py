"""Tiny experiments behind docs/determinism.md ("what differs today and why"): each isolates one ingredient of
the engine's or the trainer's arithmetic and prints whether the same row's result is bit for bit the same when
only the schedule changes, and the max |Δ| when it is not.

    JAX_PLATFORMS=cpu python scripts/determinism_probes.py [--only matmul delta attention softmax model]

matmul:    qnext.ops.linear (the engine's and the Flax model's projections): row 0 of an [m, K] x [K, N] product
           for m = 1..300 vs other row counts, float32 and bfloat16; and XLA's plain x @ w.T.
rmsnorm:   qnext.model.norms.rms_norm, row 0 of [m, H] vs [1, H].
delta:     the chunked gated delta rule (qnext/model/dense_delta_rule.py) with chunk 16 / 32 / 64, a sequence cut
           into two calls at position 40 (state carried), and the token-by-token recurrence (the decode form),
           vs the full-sequence chunk-64 pass (the trainer's).
attention: one query's softmax attention over L = 300 keys, vs the same keys padded (masked) to 320 / 512.
softmax:   jax.nn.log_softmax of a row alone vs in a batch of 8, and fused with the lm_head matmul vs not.
model:     logits of a prompt: the Flax forward vs the engine's one-step prefill (qnext.load_model), float32 and
           bfloat16 (a tiny random qwen3_5 checkpoint).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROBES = ("matmul", "rmsnorm", "delta", "attention", "softmax", "model")


def verdict(a, b) -> str:
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if np.array_equal(a, b):
        return "bitwise equal"
    return f"differ: max|Δ| {float(np.abs(a - b).max()):.3g} ({int((a != b).sum())}/{a.size} values)"


def matmul(out):
    import jax
    import jax.numpy as jnp

    from qnext.ops.linear import linear

    key = jax.random.PRNGKey(0)
    run = jax.jit(linear)
    dot = jax.jit(lambda x, w: x @ w.T)            # XLA's dot without linear's row-count paths
    for dtype in (jnp.float32, jnp.bfloat16):
        for k, n in ((64, 512), (1024, 1024), (2048, 4096)):
            x = jax.random.normal(key, (300, k), jnp.float32).astype(dtype)
            w = (jax.random.normal(jax.random.PRNGKey(1), (n, k), jnp.float32) / k ** 0.5).astype(dtype)
            rows = {m: run(x[:m], w)[0] for m in (1, 2, 8, 16, 32, 33, 64, 300)}
            for m, base in ((2, 1), (8, 1), (33, 1), (2, 8), (16, 8), (32, 8), (33, 64), (300, 64)):
                out(f"matmul {jnp.dtype(dtype).name} K={k} N={n}: row 0 of {m} rows vs {base}: "
                    f"{verdict(rows[m], rows[base])}")
        plain = {m: dot(x[:m], w)[0] for m in (1, 2, 8, 300)}
        for m, base in ((2, 1), (8, 2), (300, 2)):
            out(f"plain x @ w.T {jnp.dtype(dtype).name} K={k} N={n}: row 0 of {m} rows vs {base}: "
                f"{verdict(plain[m], plain[base])}")


def rmsnorm(out):
    import jax
    import jax.numpy as jnp

    from qnext.model.norms import rms_norm

    run = jax.jit(rms_norm, static_argnums=2)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(jax.random.PRNGKey(2), (300, 1024), jnp.float32).astype(dtype)
        w = jnp.zeros((1024,), dtype)
        one = run(x[:1], w, 1e-6)[0]
        for m in (8, 300):
            out(f"rmsnorm {jnp.dtype(dtype).name} H=1024: row 0 of {m} rows vs 1 row: {verdict(run(x[:m], w, 1e-6)[0], one)}")


def delta_inputs(t=128, hk=2, hv=4, d=32):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)   # noqa: E731
    q = unit(jax.random.normal(ks[0], (1, t, hk, d))) * d ** -0.5
    k = unit(jax.random.normal(ks[1], (1, t, hk, d)))
    v = jax.random.normal(ks[2], (1, t, hv, d))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, t, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, t, hv)))
    return q, k, v, g, beta


def delta(out):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gated_delta_rule import gated_delta_rule_token_scan
    from qnext.model.dense_delta_rule import dense_gated_delta_rule_with_state

    q, k, v, g, beta = delta_inputs()
    rule = jax.jit(dense_gated_delta_rule_with_state, static_argnums=6)
    full = rule(q, k, v, g, beta, None, 64)[0][0]
    for chunk in (16, 32):
        out(f"delta rule: chunk {chunk} vs chunk 64, 128 tokens: {verdict(rule(q, k, v, g, beta, None, chunk)[0][0], full)}")
    cut = 40
    head, state = rule(*(x[:, :cut] for x in (q, k, v, g, beta)), None, 64)
    tail, _ = rule(*(x[:, cut:] for x in (q, k, v, g, beta)), state, 64)
    out(f"delta rule: cut at 40 (chunks 0-39 | 40-103 | 104-127) vs one pass (0-63 | 64-127): "
        f"{verdict(jnp.concatenate([head, tail], 1)[0], full)}")
    same_cut_head, s64 = rule(*(x[:, :64] for x in (q, k, v, g, beta)), None, 64)
    same_cut_tail, _ = rule(*(x[:, 64:] for x in (q, k, v, g, beta)), s64, 64)
    out(f"delta rule: cut at 64 (a chunk boundary) vs one pass: "
        f"{verdict(jnp.concatenate([same_cut_head, same_cut_tail], 1)[0], full)}")
    scan = jax.jit(gated_delta_rule_token_scan)(q[0], k[0], v[0], g[0], beta[0])[0]
    out(f"delta rule: token-by-token recurrence (decode) vs chunk 64: {verdict(scan, full)}")
    batch = [jnp.concatenate([x, jnp.roll(x, 3, axis=1)] * 4, 0) for x in (q, k, v, g, beta)]
    out(f"delta rule: row 0 of a batch of 8 vs batch of 1, chunk 64: {verdict(rule(*batch, None, 64)[0][0], full)}")


def attention(out):
    import jax
    import jax.numpy as jnp

    d, length = 64, 300
    q = jax.random.normal(jax.random.PRNGKey(4), (d,))
    keys = jax.random.normal(jax.random.PRNGKey(5), (512, d))
    values = jax.random.normal(jax.random.PRNGKey(6), (512, d))

    @jax.jit
    def attend(q, keys, values, n_valid):
        scores = jnp.where(jnp.arange(keys.shape[0]) < n_valid, keys @ q * d ** -0.5, -jnp.inf)
        return jax.nn.softmax(scores) @ values

    exact = attend(q, keys[:length], values[:length], length)
    for padded in (320, 512):
        out(f"attention: 300 keys padded to {padded} (masked) vs exactly 300: "
            f"{verdict(attend(q, keys[:padded], values[:padded], length), exact)}")


def softmax(out):
    import jax
    import jax.numpy as jnp

    h = jax.random.normal(jax.random.PRNGKey(7), (8, 1024))
    w = jax.random.normal(jax.random.PRNGKey(8), (32000, 1024)) / 32.0
    logits = jax.jit(lambda h, w: h @ w.T)(h, w)
    run = jax.jit(jax.nn.log_softmax)
    out(f"log_softmax: row 0 of 8 rows vs 1 row (V=32000): {verdict(run(logits)[0], run(logits[:1])[0])}")
    fused = jax.jit(lambda h, w: jax.nn.log_softmax(h @ w.T))(h, w)
    out(f"log_softmax fused with the lm_head matmul vs separate jits: {verdict(fused, run(logits))}")


def model(out):
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import qnext
    import qnext.flax as qflax
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(Path(tmp) / "tiny", "qwen3_5")
        ids = np.random.default_rng(0).integers(0, 512, 300).tolist()
        for dtype in ("float32", "bfloat16"):
            flax_model = qflax.from_pretrained(path, dtype=dtype)
            dense = np.asarray(nnx.jit(lambda m, i: m(i, jnp.ones_like(i)))(flax_model, jnp.asarray([ids])))[0]
            engine = qnext.load_model(path, dtype).logits(ids)
            out(f"logits {dtype}, 300-token prompt: Flax forward vs the engine's one-step prefill: {verdict(dense, engine)}")
            batch = np.asarray(nnx.jit(lambda m, i: m(i, jnp.ones_like(i)))(
                flax_model, jnp.asarray([ids] + [ids[::-1]] * 7)))[0]
            out(f"logits {dtype}: Flax forward, row 0 of a batch of 8 vs alone: {verdict(batch, dense)}")


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=PROBES, default=list(PROBES))
    args = p.parse_args(argv)
    lines = []

    def out(line):
        print(line, flush=True)
        lines.append(line)

    for name in args.only:
        globals()[name](out)
    return lines


if __name__ == "__main__":
    main()
