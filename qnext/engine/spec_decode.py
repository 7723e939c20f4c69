"""Speculative decoding's acceptance step: k draft tokens checked against the target's k + 1 distributions.

Given, per row, the draft tokens d_1..d_k with the draft's distributions q_1..q_k they were drawn from, and the
target's distributions p_1..p_{k+1} at the same positions (p_i is the target's distribution for the token that d_i
proposes; p_{k+1} follows d_k), the row emits its accepted prefix and one more token:
- greedy (temperature 0): d_i is accepted while d_i == argmax p_i; the first mismatch emits argmax p_i instead;
  if all k agree, argmax p_{k+1} follows. The emitted tokens are exactly plain greedy decoding's.
- sampled: d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) (stop at the first rejection); a rejection
  at i emits a draw from the residual max(0, p_i - q_i) normalised; if all k are accepted, a draw from p_{k+1}.
  Each emitted token is distributed exactly as p at its position (Leviathan et al. 2023, Chen et al. 2023), so
  the output keeps the target's distribution whatever the draft.
Only the emitted tokens may reach a sequence's state: the caller keeps the target's states after position
`num_accepted` (the last accepted draft) and discards the rest.

All arrays are batched [N, ...] and the function is jittable; randomness comes from `key` (one per call).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Acceptance(NamedTuple):
    tokens: jax.Array          # [N, k + 1] int32: emitted tokens, valid up to num_emitted (the rest repeat the last)
    num_accepted: jax.Array    # [N] int32 in [0, k]: draft tokens accepted
    num_emitted: jax.Array     # [N] int32 = num_accepted + 1


def _first_false(ok):
    """ok [N, k] bool -> [N] int32: the index of the first False (k when all are True)."""
    k = ok.shape[1]
    return jnp.min(jnp.where(ok, k, jnp.arange(k)[None, :]), axis=1).astype(jnp.int32)


def _emit(draft, accepted, last):
    """Emitted tokens [N, k + 1]: draft[:, :accepted], then `last` at index `accepted` (and after it)."""
    k = draft.shape[1]
    cols = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([draft, last[:, None]], axis=1)
    return jnp.where(cols < accepted[:, None], padded, last[:, None]).astype(jnp.int32)


def accept_greedy(draft_tokens, target_logits) -> Acceptance:
    """draft_tokens: [N, k] int; target_logits: [N, k + 1, V]. Longest prefix agreeing with the target's argmax."""
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)          # [N, k + 1]
    accepted = _first_false(draft_tokens == target[:, :-1])
    last = jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
    return Acceptance(_emit(draft_tokens, accepted, last), accepted, accepted + 1)


def accept_sampled(draft_tokens, draft_probs, target_probs, key) -> Acceptance:
    """draft_tokens: [N, k] int (drawn from draft_probs); draft_probs: [N, k, V]; target_probs: [N, k + 1, V]
    (both after the row's temperature / top-k / top-p processing). Rejection sampling that keeps target_probs."""
    n, k, v = draft_probs.shape
    u_key, r_key = jax.random.split(key)
    p_d = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]     # [N, k]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(u_key, (n, k))
    ok = u * q_d < p_d                       # u < p/q without dividing; q_d > 0 for a token the draft drew
    accepted = _first_false(ok)
    # where the row stops: the residual at a rejection, the target's own next distribution after k acceptances
    rows = jnp.arange(n)
    p_stop = target_probs[rows, accepted]                                   # [N, V]
    q_stop = jnp.concatenate([draft_probs, jnp.zeros((n, 1, v), draft_probs.dtype)], axis=1)[rows, accepted]
    residual = jnp.maximum(p_stop - q_stop, 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_stop)   # p == q: any draw of p
    last = jax.random.categorical(r_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return Acceptance(_emit(draft_tokens, accepted, last), accepted, accepted + 1)


def penalized(target_logits, draft_tokens, tensors):
    """The rows' repetition / frequency / presence penalties at every window position (sampler.apply_penalties):
    position j's output so far is the row's output plus drafts d_1..d_j (what it is if those are kept, the only
    case in which position j's token is used). target_logits [N, k + 1, V]; tensors.output_counts [N, V]."""
    from qnext.engine.sampler import apply_penalties

    n, width, v = target_logits.shape
    drafted = jax.nn.one_hot(draft_tokens, v, dtype=tensors.output_counts.dtype)            # [N, k, V]
    before = jnp.concatenate([jnp.zeros((n, 1, v), drafted.dtype), jnp.cumsum(drafted, axis=1)], axis=1)
    counts = tensors.output_counts[:, None, :] + before                                     # [N, k + 1, V]

    def per_position(x):
        return jnp.repeat(x, width, axis=0)

    return apply_penalties(target_logits.reshape(n * width, v), counts.reshape(n * width, v),
                           per_position(tensors.prompt_mask), per_position(tensors.presence_penalty),
                           per_position(tensors.frequency_penalty), per_position(tensors.repetition_penalty)
                           ).reshape(n, width, v)


def accept_rows(target_logits, draft_tokens, tensors=None) -> Acceptance:
    """The engine's acceptance for a batch of rows whose drafts are the MTP head's greedy picks (a one-hot draft
    distribution q = [d]). target_logits [N, k + 1, V] raw float32; draft_tokens [N, k]; tensors: the rows'
    SamplingTensors (sampler.py; None: every row greedy). Greedy rows: accept_greedy. Sampled rows: rejection
    sampling against q = [d]: d_i is accepted with probability p_i(d_i); a rejection at i draws from p_i without
    d_i (max(0, p - q), renormalised); all accepted draws from p_{k+1} (p: the row's filtered distribution,
    penalties (per window position: `penalized`), temperature / top-k / top-p / min-p as `sample`; greedy rows take
    the argmax of the penalized logits too). The random numbers of row r at window position i come from
    the row's key at output position + i (as `sample`), so a request's tokens depend on its seed and history only.
    """
    from qnext.engine.sampler import GREEDY_TEMPERATURE, filter_logits, row_keys
    from qnext.model.argmax import first_argmax

    n, width, v = target_logits.shape
    k = width - 1
    if tensors is not None and tensors.output_counts is not None:
        target_logits = penalized(target_logits, draft_tokens, tensors)
    target = first_argmax(target_logits)                                   # [N, k + 1]
    greedy_accepted = _first_false(draft_tokens == target[:, :-1])
    greedy_last = jnp.take_along_axis(target, greedy_accepted[:, None], axis=1)[:, 0]
    if tensors is None or tensors.key_data is None:
        return Acceptance(_emit(draft_tokens, greedy_accepted, greedy_last), greedy_accepted, greedy_accepted + 1)

    per_position = tensors._replace(**{
        f: jnp.repeat(getattr(tensors, f), width, axis=0)
        for f in ("temperature", "min_p", "key_data", "position", "top_k", "top_p") if getattr(tensors, f) is not None})
    per_position = per_position._replace(position=per_position.position + jnp.tile(jnp.arange(width), n))
    filtered = filter_logits(target_logits.reshape(n * width, v), per_position)
    probs = jax.nn.softmax(filtered, axis=-1).reshape(n, width, v)
    keys = row_keys(per_position)                                          # [N * (k + 1)]
    u_keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys)
    draw_keys = jax.vmap(lambda key: jax.random.fold_in(key, 2))(keys).reshape(n, width)
    u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(u_keys).reshape(n, width)[:, :k]
    p_d = jnp.take_along_axis(probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    accepted = _first_false(u < p_d)
    rows = jnp.arange(n)
    p_stop = probs[rows, accepted]                                         # [N, V]
    d_stop = jnp.concatenate([draft_tokens, jnp.full((n, 1), -1, draft_tokens.dtype)], axis=1)[rows, accepted]
    residual = jnp.where(jnp.arange(v)[None, :] == d_stop[:, None], 0.0, p_stop)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_stop)   # p(d) = 1: never rejected
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(draw_keys[rows, accepted])
    last = first_argmax(jnp.log(residual) + gumbel)
    greedy = tensors.temperature < GREEDY_TEMPERATURE
    accepted = jnp.where(greedy, greedy_accepted, accepted)
    last = jnp.where(greedy, greedy_last, last)
    return Acceptance(_emit(draft_tokens, accepted, last), accepted, accepted + 1)
