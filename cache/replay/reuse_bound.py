"""An upper bound on the reuse of any cache policy at a memory, by duality (the "bound" beside belady).

The model is belady's (cache/replay/belady.py): requests one at a time in trace order, the memory qnext's KV blocks
and snapshot rows share (any split), a unit (b, d) = b's blocks 1..d and the snapshot at d resident when b is
admitted saves d blocks. Relaxed generously, so that every schedule of the model is feasible in it:
- a block or snapshot is held over a gap: from the last request before b that holds that block (every request that
  holds a block refreshes it; the snapshot there is assumed computed, even where that request restored past it)
  to b's admission. Items are counted once per gap; the gaps of one block never overlap.
- a snapshot is free while the request that made it runs; a request's own blocks are all that it holds.
- x(b, d) in [0, 1] with sum_d x(b, d) <= 1 (fractions of units allowed).
Constraints, per request t: while t runs, its own blocks + the gaps over it (ending after t) fit the memory; at t's
admission, the gaps over it or ending at it (t's reused prefix and snapshot) fit the memory.

Any schedule of the model is a 0/1 point of this LP (a reused unit's items are resident over their gaps, and
resident items fit the memory at every admission and while every request runs), so the LP's optimum bounds the best
reuse of the model, and by weak duality so does the Lagrangian L(lam) for every lam >= 0: each request then picks
its best depth against the prices alone. Subgradient steps lower L; every value it takes is a valid bound and the
smallest is reported (it approaches the LP optimum, which itself may exceed the best 0/1 schedule).
What the model leaves out, and so what the bound covers: it bounds policies that run one request at a time in
trace order. qnext runs `in_flight` at once, which costs memory (several requests' own blocks) and reuse (a
request cannot reuse what a running one has not committed); the one thing concurrency could add is that a unit
a still-running request will make takes no memory before it is made, at most in_flight - 1 requests' worth.
"""
import numpy as np

from cache.replay.belady import TraceFacts


def reuse_bound(facts: TraceFacts, memory: int, block_size: int, state_kv_tokens: int, lower: int = 0,
                iterations: int = 1500) -> dict:
    """The smallest L(lam) found, in reused tokens and as reuse (a share of the prompt tokens). `lower`: a known
    feasible reuse in tokens (belady's), the target of the Polyak steps."""
    bs, r, n = block_size, state_kv_tokens, len(facts.chains)
    own = np.array(facts.own_blocks) * bs
    if (own > memory).any():
        t = int(np.argmax(own > memory))
        raise ValueError(f"request {t} needs {own[t]} tokens of KV alone; the cache has {memory}")
    rows = [(b, k, a) for b in range(n) for k, a in enumerate(facts.last_touch[b])]
    if not rows:
        return {"reuse": 0.0, "reused_tokens": 0, "iterations": 0}
    req, start = np.array([x[0] for x in rows]), np.array([x[2] for x in rows])
    seg = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])           # first row of each request's segment
    seg_of = np.repeat(np.arange(len(seg)), np.diff(np.r_[seg, len(rows)]))
    rank = np.arange(len(rows))
    cap_run, cap_admit = memory - own, np.full(n, memory)
    lam_run, lam_admit = np.zeros(n), np.zeros(n)
    best, step, stale = float("inf"), 1.0, 0
    for it in range(iterations):
        la, mu = np.r_[0.0, np.cumsum(lam_run)], np.r_[0.0, np.cumsum(lam_admit)]
        price = la[req] - la[start + 1] + mu[req + 1] - mu[start + 1]      # per token held over the gap
        gain = np.cumsum(bs * (1.0 - price))
        gain -= np.repeat(np.r_[0.0, gain[seg[1:] - 1]], np.diff(np.r_[seg, len(rows)]))
        value = gain - r * price                       # per row: the unit that ends at that block
        seg_best = np.maximum.reduceat(value, seg)
        dual = lam_run @ cap_run + lam_admit @ cap_admit + np.maximum(seg_best, 0.0).sum()
        if dual < best - 1e-6:
            best, stale = dual, 0
        else:
            stale += 1
            if stale >= 15:
                step, stale = step / 2, 0
        chosen = np.minimum.reduceat(np.where(value >= seg_best[seg_of], rank, len(rows)), seg)
        active = seg_best > 0
        kv_rows = active[seg_of] & (rank <= chosen[seg_of])
        snap_rows = chosen[active]
        lo = np.r_[start[kv_rows], start[snap_rows]] + 1                 # gap: after its last holder ...
        hi = np.r_[req[kv_rows], req[snap_rows]]                         # ... to its request's admission
        size = np.r_[np.full(kv_rows.sum(), float(bs)), np.full(len(snap_rows), float(r))]
        use_run = np.cumsum(np.bincount(lo, size, n + 1) - np.bincount(hi, size, n + 1))[:n]
        use_admit = np.cumsum(np.bincount(lo, size, n + 2) - np.bincount(hi + 1, size, n + 2))[:n]
        g_run, g_admit = cap_run - use_run, cap_admit - use_admit
        norm = g_run @ g_run + g_admit @ g_admit
        if step < 1e-4 or norm == 0 or best - lower < 0.5:
            break
        t = step * (dual - lower) / norm
        lam_run, lam_admit = np.maximum(0.0, lam_run - t * g_run), np.maximum(0.0, lam_admit - t * g_admit)
    return {"reuse": float(best) / facts.prompt_tokens, "reused_tokens": float(best), "iterations": it + 1}
