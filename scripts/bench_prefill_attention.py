"""The CPU prefill attention of one long-prompt step: group-wise (each 32-query group reads the whole context) against
by sequence (qnext/model/prefill_attention.py: the context read once), side by side in one process.

    python scripts/bench_prefill_attention.py                       # contexts 8k, 32k, 64k; 2048-token steps
    python scripts/bench_prefill_attention.py --contexts 8192 65536 --heads 4 2 --head-dim 32

One step's prefill view as the engine lays it out (the prompt's chunk of --tokens new tokens in groups of --chunk, the
bucket's 8 spare groups as padding) over a paged context of each length, float32, the tiny model's attention shape
by default. Each function is compiled once, then timed --reps times, alternating; the minimum of each is reported
(the machine is shared: the minimum is the least disturbed run)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--tokens", type=int, default=2048, help="new tokens in the step")
    p.add_argument("--chunk", type=int, default=32, help="queries per prefill group")
    p.add_argument("--heads", type=int, nargs=2, default=[4, 2], metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import paged_attention_reference
    from qnext.model.prefill_attention import prefill_attention_by_sequence

    hq, hkv = args.heads
    d, bs, c = args.head_dim, 16, args.chunk
    groups = -(-args.tokens // c)
    n = groups + 8
    group_wise = jax.jit(lambda q, k, v, t, kl, qp, f, ln: paged_attention_reference(q, k, v, t, kl, qp, sm_scale=0.1))
    by_sequence = jax.jit(lambda *a: prefill_attention_by_sequence(*a, sm_scale=0.1))
    print(f"{'context':>8} {'group-wise s':>13} {'by sequence s':>14} {'speed-up':>9}", flush=True)
    for context in args.contexts:
        rng = np.random.default_rng(0)
        blocks = context // bs
        k_pages = jnp.asarray(rng.standard_normal((hkv, blocks + 1, bs, d)), jnp.float32)
        v_pages = jnp.asarray(rng.standard_normal((hkv, blocks + 1, bs, d)), jnp.float32)
        table = np.zeros((n, blocks), np.int32)
        table[:groups] = np.arange(1, blocks + 1)
        kv_len = np.where(np.arange(n) < groups, context, 0).astype(np.int32)
        pos = np.full((n, c), -1, np.int32)
        pos[:groups] = (context - args.tokens + np.arange(groups * c)).reshape(groups, c)
        is_first = np.arange(n) == 0
        is_first[groups:] = True
        length = np.where(np.arange(n) < groups, c, 0).astype(np.int32)
        q = jnp.asarray(rng.standard_normal((n, c, hq, d)), jnp.float32)
        call = (q, k_pages, v_pages, table, kv_len, pos, is_first, length)
        times = {group_wise: [], by_sequence: []}
        for fn in times:
            jax.block_until_ready(fn(*call))                 # compile
        for _ in range(args.reps):
            for fn, seen in times.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(*call))
                seen.append(time.perf_counter() - start)
        old, new = min(times[group_wise]), min(times[by_sequence])
        print(f"{context:>8} {old:>13.3f} {new:>14.3f} {old / new:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
