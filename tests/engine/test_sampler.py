import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.engine.postprocess import check_stop
from qnext.engine.sampler import apply_min_p, apply_penalties, first_argmax, row_keys, sample
from qnext.engine.top_k_top_p import (WINDOW, apply_top_k_top_p, top_k_top_p_by_bisection, top_k_top_p_by_sort,
                                      window_settles)
from qnext.engine.sampling_inputs import PenaltyState, SamplerInputBuilder, SamplingRow, logprobs_bucket
from qnext.outputs import Logprob, logprobs_entry
from qnext.sampling_params import SamplingParams

V = 32
N = 8
EOS = 2


def run(logits, rows, builder=None, num_rows=None):
    builder = builder or SamplerInputBuilder(logits.shape[1], eos_token_ids=[EOS], seed=0)
    tensors, k = builder.build(rows, num_rows or logits.shape[0])
    out = sample(logits, tensors, num_logprobs=k)
    return {name: np.asarray(x) for name, x in out._asdict().items()}


def random_logits(seed, n=N, v=V, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((n, v)) * scale).astype(np.float32)


def row(params, output=(), prompt=(1,), request_id=None, index=0):
    return SamplingRow(request_id or f"r{index}", params, list(prompt), list(output), index)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_greedy_is_argmax_with_raw_logprobs():
    logits = random_logits(0)
    logits[1, [3, 17]] = logits[1].max() + 1.0                   # a tie: the first index wins, as in np.argmax
    out = run(logits, [row(SamplingParams(temperature=0.0, logprobs=0), index=i) for i in range(N)])
    np.testing.assert_array_equal(out["token_ids"], logits.argmax(-1))
    assert out["token_ids"][1] == 3
    np.testing.assert_allclose(out["logprobs"], log_softmax(logits).max(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["ranks"], 1)
    assert out["top_ids"].shape == (N, 0)
    # Nobody asked for logprobs: same tokens, the log-softmax is skipped.
    skipped = run(logits, [row(SamplingParams(temperature=0.0), index=i) for i in range(N)])
    np.testing.assert_array_equal(skipped["token_ids"], out["token_ids"])
    assert not np.any(skipped["logprobs"])


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = random_logits(1)
    params = [SamplingParams(temperature=5.0, top_k=1, seed=3), SamplingParams(temperature=5.0, top_p=1e-6)]
    rows = [row(params[i % 2], output=[0] * i, index=i) for i in range(N)]
    out = run(logits, rows)
    np.testing.assert_array_equal(out["token_ids"], logits.argmax(-1))


def test_top_k_top_p_filter_support():
    # Probabilities 0.4, 0.3, 0.2, 0.1: top_k=2 -> {0, 1}; top_p=0.6 -> {0, 1} (0.4 < 0.6, then 0.7 >= 0.6).
    n = 512
    logits = np.tile(np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32)), (n, 1))
    rows = [row(SamplingParams(top_k=2) if i % 2 else SamplingParams(top_p=0.6), index=i) for i in range(n)]
    tokens = run(logits, rows)["token_ids"]
    assert set(tokens.tolist()) == {0, 1}


def test_sampling_distribution_temperature_and_min_p():
    # One call, three groups of rows over p = [0.6, 0.3, 0.1]:
    #   temperature 1 -> p;  temperature 0.5 -> p^2 normalised;  min_p 0.2 drops p < 0.12 -> [2/3, 1/3, 0].
    n = 3000
    p = np.array([0.6, 0.3, 0.1])
    logits = np.tile(np.log(p).astype(np.float32), (3 * n, 1))
    groups = [SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(min_p=0.2)]
    rows = [row(groups[i // n], index=i) for i in range(3 * n)]
    tokens = run(logits, rows)["token_ids"].reshape(3, n)
    expected = [p, p**2 / (p**2).sum(), np.array([2 / 3, 1 / 3, 0.0])]
    for group_tokens, want in zip(tokens, expected):
        freq = np.bincount(group_tokens, minlength=3) / n
        np.testing.assert_allclose(freq, want, atol=4 * np.sqrt(0.25 / n))
    assert np.count_nonzero(tokens[2] == 2) == 0


def test_seeded_request_is_independent_of_batch():
    logits = random_logits(2, scale=0.5)  # flat enough that different keys draw different tokens
    seeded = SamplingParams(seed=1234)
    drawn = {}
    for layout, slot in (("first", 0), ("last", N - 1)):
        others = random_logits(3 if slot else 4)
        tokens = []
        for step in range(6):
            batch = others.copy()
            batch[slot] = logits[0]
            rows = [row(SamplingParams(seed=i + 10 * slot), output=[5] * i, index=i) for i in range(N)]
            rows[slot] = row(seeded, output=[7] * step, request_id="seeded", index=99 + slot)
            tokens.append(int(run(batch, rows)["token_ids"][slot]))
        drawn[layout] = tokens
    assert drawn["first"] == drawn["last"]
    assert len(set(drawn["first"])) > 1  # the output position feeds the key


def test_unseeded_requests_follow_engine_seed_and_arrival_index():
    logits = np.tile(random_logits(5, n=1, scale=0.3), (N, 1))
    rows = [row(SamplingParams(), index=i) for i in range(N)]
    a = run(logits, rows, SamplerInputBuilder(V, seed=0))["token_ids"]
    b = run(logits, rows, SamplerInputBuilder(V, seed=0))["token_ids"]
    c = run(logits, rows, SamplerInputBuilder(V, seed=1))["token_ids"]
    np.testing.assert_array_equal(a, b)
    assert len(set(a.tolist())) > 1 and not np.array_equal(a, c)


def penalised_reference(logits, counts, prompt_mask, presence, frequency, repetition):
    out = logits.copy()
    for i in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if counts[i, t] > 0 or prompt_mask[i, t]:
                out[i, t] = out[i, t] / repetition[i] if out[i, t] > 0 else out[i, t] * repetition[i]
            out[i, t] -= frequency[i] * counts[i, t] + presence[i] * (counts[i, t] > 0)
    return out


def test_penalties_match_vllm_definition():
    rng = np.random.default_rng(6)
    logits = random_logits(6)
    counts = rng.integers(0, 3, (N, V)).astype(np.int32) * (rng.random((N, V)) < 0.3)
    prompt_mask = rng.random((N, V)) < 0.2
    presence, frequency = rng.uniform(-2, 2, N).astype(np.float32), rng.uniform(-2, 2, N).astype(np.float32)
    repetition = rng.uniform(0.5, 2.0, N).astype(np.float32)
    got = apply_penalties(logits, counts, prompt_mask, presence, frequency, repetition)
    want = penalised_reference(logits, counts, prompt_mask, presence, frequency, repetition)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_greedy_with_penalties_picks_argmax_of_penalised_logits():
    rng = np.random.default_rng(7)
    logits = random_logits(7, scale=1.0)
    rows, counts, prompt_mask = [], np.zeros((N, V), np.int32), np.zeros((N, V), bool)
    penalties = [(0.0, 0.0, 1.0), (1.5, 0.0, 1.0), (0.0, 1.0, 1.0), (0.0, 0.0, 2.0), (0.5, 0.5, 1.5)]
    for i in range(N):
        prompt = rng.integers(0, V, 5).tolist()
        # Penalise the currently best tokens so that the penalties decide the argmax.
        output = np.argsort(-logits[i])[:3].repeat(2).tolist()
        pres, freq, rep = penalties[i % len(penalties)]
        params = SamplingParams(temperature=0.0, presence_penalty=pres, frequency_penalty=freq,
                                repetition_penalty=rep)
        rows.append(row(params, output=output, prompt=prompt, index=i))
        np.add.at(counts[i], output, 1)
        prompt_mask[i, prompt] = True
    pres, freq, rep = (np.array([penalties[i % len(penalties)][j] for i in range(N)], np.float32)
                       for j in range(3))
    want = penalised_reference(logits, counts, prompt_mask, pres, freq, rep).argmax(-1)
    np.testing.assert_array_equal(run(logits, rows)["token_ids"], want)
    assert not np.array_equal(want, logits.argmax(-1))


def test_penalty_state_counts_incrementally():
    state = PenaltyState(V)
    output = [3, 3, 5]
    counts, mask = state.get("a", [1, 2, 2], output)
    output += [3, 9]
    counts, mask = state.get("a", [1, 2, 2], output)
    np.testing.assert_array_equal(counts, np.bincount(output, minlength=V))
    np.testing.assert_array_equal(np.flatnonzero(mask), [1, 2])
    state.free("a")
    assert len(state) == 0


def test_min_tokens_suppresses_eos_and_stop_token_ids():
    logits = np.zeros((N, V), np.float32)
    logits[:, EOS] = 10.0
    logits[:, 9] = 9.0
    logits[:, 4] = 8.0
    greedy = dict(temperature=0.0)
    rows = [
        row(SamplingParams(**greedy, min_tokens=2), output=[1], index=0),  # eos masked -> 9
        row(SamplingParams(**greedy, min_tokens=2), output=[1, 1], index=1),  # reached -> eos
        row(SamplingParams(**greedy, min_tokens=3, stop_token_ids=[9]), output=[1], index=2),  # -> 4
        row(SamplingParams(**greedy, min_tokens=3, ignore_eos=True), output=[], index=3),  # eos allowed
        row(SamplingParams(min_tokens=5, seed=0), output=[], index=4),  # sampled: never eos
    ]
    tokens = run(logits, rows)["token_ids"]
    assert tokens[:4].tolist() == [9, EOS, 4, EOS]
    assert tokens[4] != EOS


def test_logprobs_are_raw_log_softmax_sorted_top_k():
    logits = random_logits(8)
    rows = [row(SamplingParams(temperature=0.7, logprobs=3, seed=i), index=i) for i in range(N)]
    out = run(logits, rows)
    want = log_softmax(logits)
    assert out["top_logprobs"].shape == (N, 4)  # bucketed: logprobs=3 -> K=4
    np.testing.assert_array_equal(out["top_ids"], np.argsort(-want, axis=-1)[:, :4])
    np.testing.assert_allclose(out["top_logprobs"], np.sort(want, axis=-1)[:, ::-1][:, :4], rtol=1e-5, atol=1e-5)
    taken = want[np.arange(N), out["token_ids"]]
    np.testing.assert_allclose(out["logprobs"], taken, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["ranks"], (want > taken[:, None]).sum(-1) + 1)

    i = int(np.argmax(out["ranks"]))
    entry = logprobs_entry(out["token_ids"][i], out["logprobs"][i], out["ranks"][i], out["top_ids"][i],
                           out["top_logprobs"][i], 3, decode=str)
    assert list(entry)[:3] == out["top_ids"][i, :3].tolist()
    assert [e.rank for e in list(entry.values())[:3]] == [1, 2, 3]
    assert entry[int(out["token_ids"][i])] == Logprob(pytest.approx(float(taken[i])), int(out["ranks"][i]),
                                                      str(out["token_ids"][i]))


@pytest.mark.parametrize("requested, bucket", [(0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (20, 32)])
def test_logprobs_bucket(requested, bucket):
    assert logprobs_bucket(requested) == bucket


def test_builder_pads_and_rejects_oversized_batch():
    builder = SamplerInputBuilder(V, eos_token_ids=[EOS])
    tensors, k = builder.build([row(SamplingParams(logprobs=0), index=0)], N)
    assert k == 0 and tensors.temperature.shape == (N,) and tensors.top_k is None and tensors.output_counts is None
    np.testing.assert_array_equal(tensors.temperature[1:], 0.0)  # padding rows are greedy
    with pytest.raises(ValueError, match="3 rows do not fit a batch of 2"):
        builder.build([row(SamplingParams(), index=i) for i in range(3)], 2)


def test_check_stop():
    p = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[7])
    eos = (EOS, 9)
    assert check_stop(p, [EOS], eos, 10, 100) is None  # below min_tokens
    assert check_stop(p, [1, 9], eos, 10, 100) == ("stop", None)
    assert check_stop(p, [1, 7], eos, 10, 100) == ("stop", 7)
    assert check_stop(p, [1, 1, 1], eos, 10, 100) is None
    assert check_stop(p, [1, 1, 1, EOS], eos, 10, 100) == ("stop", None)  # eos wins over the length limit
    assert check_stop(p, [1, 1, 1, 1], eos, 10, 100) == ("length", None)
    assert check_stop(p, [1, 1], eos, 100, 100) == ("length", None)  # max_model_len
    assert check_stop(SamplingParams(ignore_eos=True), [EOS], eos, 10, 100) is None
    assert check_stop(SamplingParams(max_tokens=None), [1] * 50, eos, 60, 100) is None


def test_plain_greedy_rows_are_those_whose_token_is_the_raw_argmax():
    """The runner takes such rows' tokens from the step's own argmax and skips the sampler: each case the sampler
    must see (sampling, logprobs, penalties, ids suppressed by min_tokens) must say no."""
    builder = SamplerInputBuilder(V, eos_token_ids=[EOS], seed=0)
    greedy = dict(temperature=0.0)
    plain = [row(SamplingParams(**greedy), index=0),
             row(SamplingParams(**greedy, min_tokens=2), output=[1, 1], index=1),         # min_tokens reached
             row(SamplingParams(**greedy, min_tokens=3, ignore_eos=True), index=2),       # nothing to suppress
             row(SamplingParams(**greedy, top_k=5, top_p=0.5, min_p=0.1), index=3)]      # filters: no effect
    assert builder.plain_greedy(plain)
    logits = random_logits(21, n=len(plain))
    out = run(logits, plain, builder)
    np.testing.assert_array_equal(out["token_ids"], logits.argmax(-1))
    assert not out["logprobs"].any() and (out["ranks"] == 1).all()
    for params, output in [(SamplingParams(temperature=0.7, seed=1), []),
                           (SamplingParams(**greedy, logprobs=0), []),
                           (SamplingParams(**greedy, repetition_penalty=1.2), []),
                           (SamplingParams(**greedy, min_tokens=2), [1])]:                # eos still suppressed
        assert not builder.plain_greedy(plain + [row(params, output=output, index=9)])


# ---- top-k / top-p without a sort (top_k_top_p.py) -------------------------------------------------------------------
def filter_cases(seed, n, v):
    """Rows of random logits (some quantised, so ties fall on the thresholds; some with -inf ids) and top_k / top_p
    at their edges: 1, the window's bound and either side of it, V; top_p 1 (off), tiny, and near 1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, v)).astype(np.float32) * rng.choice([0.3, 1.0, 3.0, 10.0], (n, 1)).astype(np.float32)
    x[::3] = np.round(x[::3] * 2) / 2                                   # ties
    x[1::4, : v // 3] += 12.0                                           # a peak: a nucleus inside the window
    x[2::5, rng.integers(0, v, 5)] = -np.inf                            # suppressed ids
    top_k = np.minimum(rng.choice([1, 2, 20, WINDOW - 1, WINDOW, WINDOW + 1, v // 2, v - 1, v, v], n), v)
    top_p = rng.choice([1.0, 1.0, 1e-6, 0.3, 0.9, 0.95, 0.999, 0.9999999], n)
    return x, top_k.astype(np.int32), top_p.astype(np.float32)


@pytest.mark.parametrize("v", [200, 1000])
def test_top_k_top_p_window_fallback_and_sort_keep_the_same_tokens(v):
    """The window path and the bisection fallback (every row) give bit-identical logits, over 16 batches of 64
    rows; the full sort keeps the same tokens except at top_p 0.9999999, where the last tokens' masses (~1e-8) are
    below float32 rounding and a cumulative sum in sorted order decides them differently."""
    window, bisection, by_sort = (jax.jit(f) for f in (apply_top_k_top_p, top_k_top_p_by_bisection,
                                                        top_k_top_p_by_sort))
    kept = 0
    for seed in range(16):
        x, top_k, top_p = filter_cases(seed, 64, v)
        got, fallback, want = (np.asarray(f(x, top_k, top_p)) for f in (window, bisection, by_sort))
        np.testing.assert_array_equal(got, fallback)
        rounding = top_p == np.float32(0.9999999)
        np.testing.assert_array_equal(np.isfinite(got)[~rounding], np.isfinite(want)[~rounding])
        np.testing.assert_array_equal(got[np.isfinite(got)], x[np.isfinite(got)])
        kept += np.isfinite(got).sum()
        for i in np.flatnonzero(top_p >= 1.0):                          # top-k alone: the top_k largest and ties
            finite = np.sort(x[i][np.isfinite(x[i])])[::-1]
            if top_k[i] <= len(finite):
                assert np.isfinite(got[i]).sum() == (x[i] >= finite[top_k[i] - 1]).sum()
    assert 0 < kept < 16 * 64 * v


def test_top_p_keeps_tokens_whose_mass_above_is_below_top_p():
    """Probabilities 1/2, 1/4, 1/8, 1/16, 1/16 and three -inf ids: a token is kept while the mass strictly above it
    is below top_p, and a token tied with a kept one is kept."""
    x = np.array([[np.log(q / 16) for q in (8, 4, 2, 1, 1)] + [-np.inf] * 3], np.float32)
    for top_p, count in [(1e-6, 1), (0.4999, 1), (0.5001, 2), (0.7499, 2), (0.7501, 3), (0.8749, 3), (0.8751, 5),
                         (1.0, 5)]:
        args = (x, np.array([8], np.int32), np.array([top_p], np.float32))
        for f in (apply_top_k_top_p, top_k_top_p_by_bisection, top_k_top_p_by_sort):
            assert np.isfinite(np.asarray(f(*args))).sum() == count, (f.__name__, top_p)


def sampled_rows(logits, params, builder):
    return run(logits, [row(p, output=[0] * i, index=i, request_id=f"q{i}") for i, p in enumerate(params)], builder)


def test_tokens_do_not_depend_on_a_row_that_takes_the_fallback():
    """A batch of top-k / top-p rows draws the same tokens, with the same seeds, whether or not another row in the
    batch (top_k above the window) sends the filter down its bisection fallback, and the same tokens as the full
    sort would give (drawn from the same keys)."""
    v, n = 2048, 24
    x, top_k, top_p = filter_cases(99, n, v)
    temperature = np.random.default_rng(5).choice([0.0, 0.5, 1.0, 1.7], n)
    params = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=0.05 * (i % 3), seed=i)
              for i, (t, k, p) in enumerate(zip(temperature, np.minimum(top_k, WINDOW), top_p))]
    builder = SamplerInputBuilder(v, seed=0)
    alone = sampled_rows(x, params, builder)["token_ids"]
    forcing = params[:-1] + [SamplingParams(temperature=1.0, top_k=WINDOW + 7, seed=7)]
    with_fallback = sampled_rows(x, forcing, builder)["token_ids"]
    np.testing.assert_array_equal(with_fallback[:-1], alone[:-1])

    tensors, _ = builder.build([row(p, output=[0] * i, index=i, request_id=f"q{i}") for i, p in enumerate(params)], n)
    scaled = x / np.where(temperature < 1e-5, 1.0, temperature)[:, None].astype(np.float32)
    assert np.asarray(window_settles(scaled, tensors.top_k, tensors.top_p)).all()     # alone: no fallback
    forcing_k = np.where(np.arange(n) == n - 1, WINDOW + 7, tensors.top_k)
    assert not np.asarray(window_settles(scaled, forcing_k, tensors.top_p))[-1]
    filtered = apply_min_p(top_k_top_p_by_sort(scaled, tensors.top_k, tensors.top_p), tensors.min_p)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(row_keys(tensors))
    want = np.where(temperature < 1e-5, x.argmax(-1), np.asarray(first_argmax(filtered + gumbel)))
    np.testing.assert_array_equal(alone, want)
    assert len(set(alone.tolist())) > n // 2


def test_top_k_top_p_at_qwen35_vocabulary():
    """248,320 ids: peaked rows settle in the window, a flat top_p row and a top_k above the window fall back;
    every row keeps the tokens the full sort keeps."""
    from qnext.testing.qwen_tokenizer import QWEN35_VOCAB_SIZE as v

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, v)).astype(np.float32) * 2
    x[:2, rng.integers(0, v, 60)] += 14.0
    top_k = np.array([20, v, v, 1000], np.int32)
    top_p = np.array([0.95, 0.9, 0.95, 1.0], np.float32)
    got, want = (np.isfinite(np.asarray(jax.jit(f)(x, top_k, top_p)))
                 for f in (apply_top_k_top_p, top_k_top_p_by_sort))
    np.testing.assert_array_equal(got, want)
    assert got[0].sum() <= 20 and got[1].sum() <= WINDOW < got[2].sum() and got[3].sum() == 1000
