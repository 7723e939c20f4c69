"""The acceptance step of speculative decoding (qnext/engine/spec_decode.py): greedy acceptance emits plain greedy
decoding's tokens whatever the draft (all accepted or all rejected alike), and rejection sampling keeps the
target's distribution (chi-square on a small vocabulary), which an accept-everything rule visibly breaks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from qnext.engine.spec_decode import accept_greedy, accept_sampled

V, K, N = 7, 3, 40_000          # N rows per sampled run: one shape, one compilation
_accept_greedy = jax.jit(accept_greedy)


def toy_target(context: list[int]) -> np.ndarray:
    """A deterministic 'model': logits over V for the token after `context`."""
    logits = np.cos(np.arange(V) * (1 + context[-1]) + len(context))
    return logits.astype(np.float32)


def plain_greedy(prompt: list[int], steps: int) -> list[int]:
    out = list(prompt)
    for _ in range(steps):
        out.append(int(np.argmax(toy_target(out))))
    return out[len(prompt):]


def speculative_greedy(prompt: list[int], steps: int, draft) -> tuple[list[int], list[int]]:
    """Drafts K tokens with `draft(context)`, verifies them in one batch of K + 1 target positions."""
    out, accepted_counts = list(prompt), []
    while len(out) - len(prompt) < steps:
        drafts = []
        for _ in range(K):
            drafts.append(draft(out + drafts))
        logits = np.stack([toy_target(out + drafts[:i]) for i in range(K + 1)])
        acc = _accept_greedy(jnp.asarray([drafts]), jnp.asarray(logits[None]))
        n = int(acc.num_emitted[0])
        out += np.asarray(acc.tokens[0, :n]).tolist()
        accepted_counts.append(int(acc.num_accepted[0]))
    return out[len(prompt):len(prompt) + steps], accepted_counts


@pytest.mark.parametrize("mode", ["every draft accepted", "every draft rejected"])
def test_greedy_acceptance_equals_plain_decoding(mode):
    prompt, steps = [1, 4, 2], 20
    if mode == "every draft accepted":
        draft = lambda ctx: int(np.argmax(toy_target(ctx)))              # noqa: E731  the target's own pick
    else:
        draft = lambda ctx: (int(np.argmax(toy_target(ctx))) + 1) % V    # noqa: E731  never the target's pick
    tokens, accepted = speculative_greedy(prompt, steps, draft)
    assert tokens == plain_greedy(prompt, steps)
    assert set(accepted) == ({K} if mode == "every draft accepted" else {0})


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    probs = probs.astype(np.float64)
    expected = probs / probs.sum() * counts.sum()
    return chisquare(counts, expected).pvalue


def _distributions(seed: int):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V), size=K + 1).astype(np.float32)          # target, per position
    q = rng.dirichlet(np.ones(V), size=K).astype(np.float32)              # draft, per position
    return p, q


@jax.jit
def _accept_sampled(drafts, q, p, key):
    return accept_sampled(drafts, q, p, key)


def _run(p, q, n: int, seed: int, accept=_accept_sampled):
    key_d, key_a = jax.random.split(jax.random.key(seed))
    drafts = jax.random.categorical(key_d, jnp.log(jnp.asarray(q))[None].repeat(n, 0), axis=-1)   # [n, K]
    return accept(drafts.astype(jnp.int32), jnp.broadcast_to(q, (n, K, V)), jnp.broadcast_to(p, (n, K + 1, V)),
                  key_a)


def test_rejection_sampling_keeps_the_target_distribution():
    """Token j of a row that got that far is drawn from the target's p_{j+1} (the toy target's positions are
    independent of the context), for j = 0 (the first, always emitted) up to the bonus token after K accepts."""
    p, q = _distributions(0)
    acc = _run(p, q, N, 1)
    tokens, emitted = np.asarray(acc.tokens), np.asarray(acc.num_emitted)
    for j in range(K + 1):
        got = tokens[emitted > j, j]
        counts = np.bincount(got, minlength=V)
        assert counts.sum() > 1000, (j, counts.sum())
        assert chi2_pvalue(counts, p[j]) > 1e-3, (j, counts, p[j] * counts.sum())
    assert 0 < np.mean(np.asarray(acc.num_accepted)) < K            # a real mix of accepts and rejects


def test_the_chi_square_check_catches_a_biased_rule():
    """Control: accepting every draft emits the draft's distribution q, and the same check rejects it."""
    def accept_all(drafts, q, p, key):
        last = jax.random.categorical(key, jnp.log(p[:, K]), axis=-1)
        tokens = jnp.concatenate([drafts, last[:, None]], axis=1)
        return tokens, None, jnp.full(drafts.shape[0], K + 1)

    p, q = _distributions(0)
    tokens, _, _ = _run(p, q, N, 1, accept=accept_all)
    counts = np.bincount(np.asarray(tokens)[:, 0], minlength=V)
    assert chi2_pvalue(counts, p[0]) < 1e-6


def test_sampled_acceptance_with_the_target_as_draft_accepts_everything():
    p, _ = _distributions(2)
    acc = _run(p, p[:K], N, 3)
    assert np.all(np.asarray(acc.num_accepted) == K)


def test_sampled_acceptance_rejects_drafts_the_target_rules_out():
    p, q = _distributions(4)
    p[:K, 0] = 0.0                                                   # the target never picks token 0 ...
    p /= p.sum(-1, keepdims=True)
    q = np.zeros_like(q)
    q[:, 0] = 1.0                                                    # ... which the draft always proposes
    acc = _run(p, q, N, 5)
    assert np.all(np.asarray(acc.num_accepted) == 0)
    first = np.asarray(acc.tokens)[:, 0]
    assert np.all(first != 0)
    assert chi2_pvalue(np.bincount(first, minlength=V)[1:], p[0, 1:]) > 1e-3


def _accept_rows_run(p, drafts_per_row, n: int, seed: int, temperature: float = 1.0):
    """The engine's rule (accept_rows: one-hot drafts, each row its own key) on n rows of the same target."""
    from qnext.engine.sampler import SamplingTensors
    from qnext.engine.spec_decode import accept_rows

    keys = np.random.default_rng(seed).integers(0, 2 ** 32, size=(n, 2), dtype=np.uint32)
    tensors = SamplingTensors(temperature=jnp.full(n, temperature, jnp.float32), min_p=jnp.zeros(n, jnp.float32),
                              key_data=jnp.asarray(keys), position=jnp.zeros(n, jnp.int32),
                              suppressed_ids=jnp.full((n, 1), V, jnp.int32))
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p)) * temperature, (n, K + 1, V))
    return jax.jit(accept_rows)(logits, jnp.asarray(drafts_per_row, jnp.int32), tensors)


def test_engine_rule_with_greedy_drafts_keeps_the_target_distribution():
    """The engine drafts with the head's argmax (a one-hot q) and gives each row its own key: every emitted token
    is still distributed as the target's p at its position (logits scaled by the temperature, which undoes it)."""
    p, _ = _distributions(6)
    drafts = np.random.default_rng(7).integers(0, V, size=(N, K))          # a quarter random drafts, the rest
    drafts[N // 4:] = np.argmax(p[:K], axis=-1)                           # the target's likeliest tokens
    acc = _accept_rows_run(p, drafts, N, 8, temperature=0.7)
    tokens, emitted = np.asarray(acc.tokens), np.asarray(acc.num_emitted)
    for j in range(K + 1):
        counts = np.bincount(tokens[emitted > j, j], minlength=V)
        assert counts.sum() > 500, (j, counts.sum())
        assert chi2_pvalue(counts, p[j]) > 1e-3, (j, counts, p[j] * counts.sum())
    assert 0 < np.mean(np.asarray(acc.num_accepted)) < K
    # the accepted share of a draft d at position j is p_j(d): the rule is not accept-all
    first_accepted = np.asarray(acc.num_accepted) > 0
    assert abs(first_accepted.mean() - p[0][drafts[:, 0]].mean()) < 0.02


def test_penalties_apply_per_window_position_with_the_drafts_before_it():
    """Position j of a verify window is penalised as `sample` would penalise it after the row's output plus
    drafts d_1..d_j: the same counts the plain decode step would hold had it emitted those drafts."""
    from qnext.engine.sampler import SamplingTensors, apply_penalties
    from qnext.engine.spec_decode import penalized

    rng = np.random.default_rng(11)
    n, v = 3, 12
    logits = rng.normal(size=(n, K + 1, v)).astype(np.float32)
    drafts = rng.integers(0, v, size=(n, K)).astype(np.int32)
    drafts[0] = drafts[0, 0]                                       # one row drafts the same token K times
    counts = rng.integers(0, 3, size=(n, v)).astype(np.int32)
    prompt_mask = rng.random((n, v)) < 0.3
    presence, frequency = np.float32([0.5, 0.0, 1.5]), np.float32([0.2, 0.7, 0.0])
    repetition = np.float32([1.3, 1.0, 2.0])
    tensors = SamplingTensors(temperature=jnp.zeros(n), min_p=jnp.zeros(n), key_data=None,
                              position=jnp.zeros(n, jnp.int32), suppressed_ids=jnp.full((n, 1), v, jnp.int32),
                              presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                              output_counts=counts, prompt_mask=prompt_mask)
    got = np.asarray(penalized(jnp.asarray(logits), jnp.asarray(drafts), tensors))
    for j in range(K + 1):
        before = counts + np.stack([np.bincount(drafts[r, :j], minlength=v) for r in range(n)]).astype(np.int32)
        want = apply_penalties(logits[:, j], before, prompt_mask, presence, frequency, repetition)
        np.testing.assert_allclose(got[:, j], np.asarray(want), rtol=1e-6, err_msg=f"position {j}")
    assert not np.allclose(got[0, 1], np.asarray(apply_penalties(logits[:, 1], counts, prompt_mask, presence,
                                                                  frequency, repetition))[0])   # drafts count
