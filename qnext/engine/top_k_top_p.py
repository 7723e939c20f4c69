"""Top-k / top-p filtering of a batch of logit rows [N, V] without sorting the vocabulary.

The rule (vLLM's): a row keeps the logits >= its top_k-th largest value (ties kept), then, over the softmax p of
those, the tokens whose mass strictly above them is below top_p:

    f(t) = sum of p_u over logits x_u > t        keep v  iff  x_v >= kth  and  (top_p >= 1  or  f(x_v) < top_p)

f only grows as t falls, so the kept tokens are those >= one threshold tau. That is the smallest prefix of the sorted
row whose mass reaches top_p, with every token tied with its last one; `top_k_top_p_by_sort` is that reading, kept
as the reference.

A full sort of a 248,320-id row costs ~60-100 ms on a CPU core, so the threshold is found from the row's largest
WINDOW logits (`lax.top_k`): kth is the window's top_k-th value when top_k <= WINDOW; tau is guessed from the
window's running mass and checked with two exact sums over the vocabulary (f(tau) < top_p <= f(just below tau)).
A row the window cannot settle (WINDOW < top_k < V, a nucleus wider than the window, a guess off by rounding)
sends the batch through the fallback: bisections over the float32 values (32 passes over [N, V], ~0.1 ms a row
each), kth by counting, tau by the same f. Both ways compute f with one function over the same [N, V] arrays, so
a row's kept tokens (and so its draws) never depend on which way its batch went.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

WINDOW = 128   # candidates per row; covers the common top_k (20, 40, 50, 100) and most nuclei of a trained model


def apply_top_k_top_p(logits, top_k, top_p):
    """logits [N, V] f32 (-inf: excluded), top_k [N] int32 in [1, V] (V: off), top_p [N] f32 in (0, 1] (1: off)
    -> logits with the filtered tokens set to -inf."""
    tau, settled, kth, known_kth = _window_threshold(logits, top_k, top_p)
    tau = jax.lax.cond(jnp.all(settled), lambda: tau,
                       lambda: jnp.where(settled, tau, _bisect_threshold(logits, top_k, top_p, kth, known_kth)))
    return jnp.where(logits >= tau[:, None], logits, -jnp.inf)


def window_settles(logits, top_k, top_p):
    """[N] bool: whether the window gives the row's threshold (a batch where one row does not takes the fallback)."""
    return _window_threshold(logits, top_k, top_p)[1]


def _window_threshold(logits, top_k, top_p):
    """-> (tau [N], settled [N]: tau is the row's threshold, kth [N], known_kth [N]: kth is the row's)."""
    v = logits.shape[-1]
    window = min(WINDOW, v)
    candidates = jax.lax.top_k(logits, window)[0]                              # [N, W] descending
    known_kth = (top_k <= window) | (top_k >= v)
    kth = jnp.where(top_k >= v, logits.min(-1),
                    jnp.take_along_axis(candidates, jnp.clip(top_k - 1, 0, window - 1)[:, None], -1)[:, 0])
    no_top_p = top_p >= 1.0

    def with_top_p():
        p, z = _allowed_probs(logits, kth)
        tau = _guess_tau(candidates, kth, z, top_p)
        settled = known_kth & (no_top_p | _is_tau(logits, p, kth, top_p, tau))
        return jnp.where(no_top_p, kth, tau), settled

    tau, settled = jax.lax.cond(jnp.all(no_top_p), lambda: (kth, known_kth), with_top_p)
    return tau, settled, kth, known_kth


def top_k_top_p_by_bisection(logits, top_k, top_p):
    """apply_top_k_top_p's fallback for every row (a window-free path, for tests and the sampler bench)."""
    v = logits.shape[-1]
    tau = _bisect_threshold(logits, top_k, top_p, logits.min(-1), top_k >= v)
    return jnp.where(logits >= tau[:, None], logits, -jnp.inf)


def top_k_top_p_by_sort(logits, top_k, top_p):
    """The same rule over a full sort of each row (the reference; ~60-100 ms a 248k row on a CPU core). The running
    mass is a cumulative sum in sorted order where apply_top_k_top_p sums over the vocabulary: the two can differ
    only where a boundary mass is within float rounding of top_p."""
    ordered = -jnp.sort(-logits, axis=-1)                                      # [N, V] descending
    kth = jnp.take_along_axis(ordered, (top_k - 1)[:, None], -1)
    e = jnp.where(ordered >= kth, jnp.exp(ordered - ordered[:, :1]), 0.0)
    p = e / e.sum(-1, keepdims=True)
    before = jnp.concatenate([jnp.zeros_like(p[:, :1]), jnp.cumsum(p, axis=-1)[:, :-1]], axis=-1)
    keep = (ordered >= kth) & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    last = jnp.maximum(keep.sum(-1), 1) - 1
    tau = jnp.take_along_axis(ordered, last[:, None], -1)
    return jnp.where(logits >= tau, logits, -jnp.inf)


def _mass_above(logits, p, t):
    """f(t) per row: the mass of p [N, V] over logits strictly above t [N]. The one way f is summed."""
    return jnp.sum(jnp.where(logits > t[:, None], p, 0.0), axis=-1)


def _allowed_probs(logits, kth):
    """Softmax over each row's logits >= kth [N] (0 elsewhere) -> (p [N, V], its normaliser z [N, 1]: the sum of
    exp(x - max))."""
    e = jnp.where(logits >= kth[:, None], jnp.exp(logits - logits.max(-1, keepdims=True)), 0.0)
    z = e.sum(-1, keepdims=True)
    return e / z, z


def _guess_tau(candidates, kth, z, top_p):
    """The last window candidate whose running mass before it is below top_p [N]: a guess, as the running mass is
    rounded as a cumulative sum, where f sums over the vocabulary."""
    allowed = candidates >= kth[:, None]
    pc = jnp.where(allowed, jnp.exp(candidates - candidates[:, :1]), 0.0) / z
    before = jnp.cumsum(pc, axis=-1) - pc
    count = jnp.sum((before < top_p[:, None]) & allowed, axis=-1)
    return jnp.take_along_axis(candidates, jnp.clip(count - 1, 0, candidates.shape[-1] - 1)[:, None], -1)[:, 0]


def _is_tau(logits, p, kth, top_p, tau):
    """Whether tau [N] is the row's threshold: f(tau) < top_p, and either the mass at or above tau reaches top_p or
    tau is the smallest logit top-k allows."""
    below = jnp.nextafter(tau, jnp.full_like(tau, -jnp.inf))
    return (tau >= kth) & (_mass_above(logits, p, tau) < top_p) & (
        (_mass_above(logits, p, below) >= top_p) | (tau == kth))


def _bisect_threshold(logits, top_k, top_p, kth_window, known_kth):
    """Each row's threshold by bisection over the float32 order (no sort): kth = the largest value with at least
    top_k logits >= it (rows whose kth the window did not give), then tau = the smallest value with f(tau) < top_p."""
    kth = jax.lax.cond(jnp.all(known_kth), lambda: kth_window, lambda: jnp.where(
        known_kth, kth_window, _bisect(logits.min(-1), logits.max(-1),
                                       lambda t: jnp.sum(logits >= t[:, None], axis=-1) >= top_k)))
    p, _ = _allowed_probs(logits, kth)
    # the smallest t in (just below kth, max] with f(t) < top_p: bisect on "f(t) >= top_p", whose largest t is
    # just below tau; top_p >= 1 keeps everything from kth up
    below_kth = jnp.nextafter(kth, jnp.full_like(kth, -jnp.inf))
    last_over = _bisect(below_kth, logits.max(-1), lambda t: _mass_above(logits, p, t) >= top_p)
    tau = jnp.nextafter(last_over, jnp.full_like(last_over, jnp.inf))
    return jnp.where(top_p >= 1.0, kth, jnp.maximum(tau, kth))


def _bisect(lo, hi, holds):
    """The largest float32 t in [lo, hi] [N] where holds(t) [N] -> bool, for a `holds` true up to some t and false
    above it; lo when it is false everywhere above lo (whether or not it holds at lo). 32 halvings span float32."""
    lo_key, hi_key = _order_key(lo), _order_key(hi)

    def body(_, bounds):
        lo_key, hi_key = bounds
        mid = lo_key + (hi_key - lo_key + 1) // 2                              # in (lo, hi] while lo < hi
        ok = holds(_from_order_key(mid))
        return jnp.where(ok, mid, lo_key), jnp.where(ok, hi_key, mid - 1)

    lo_key, _ = jax.lax.fori_loop(0, 32, body, (lo_key, hi_key))
    return _from_order_key(lo_key)


def _order_key(x):
    """float32 -> uint32 in the same order (-0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_order_key(key):
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
