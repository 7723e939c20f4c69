"""The engine against transformers, and prefix caching against cold runs, on tiny perturbed checkpoints."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import qnext  # noqa: E402
from qnext import SamplingParams  # noqa: E402
from tests.support.hf_reference import FAMILIES, build_hf_model, save_hf_model  # noqa: E402

# One buffer shape for every engine here, so they share compilations.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=16,
              num_gpu_blocks_override=32, max_num_snapshots=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)


def ids(rng, n, vocab=512):
    return rng.integers(3, vocab, n).tolist()


def tokens_of(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        hf = build_hf_model(family, seed=11)
        out[family] = (hf, save_hf_model(hf, tmp_path_factory.mktemp(family)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_matches_transformers_generate(checkpoints, family):
    import torch

    hf, path = checkpoints[family]
    llm = qnext.LLM(path, **ENGINE)
    rng = np.random.default_rng(0)
    prompts = [ids(rng, n) for n in (5, 17, 40, 33, 70)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          eos_token_id=None)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == p


@pytest.fixture(scope="module")
def next_path(checkpoints):
    return checkpoints["qwen3_next"][1]


def first_logprob(out):
    entry = out.outputs[0].logprobs[0]
    return entry[out.outputs[0].token_ids[0]].logprob


def assert_same(cached, cold):
    assert tokens_of(cached) == tokens_of(cold)
    for a, b in zip(cached, cold):
        assert abs(first_logprob(a) - first_logprob(b)) < 1e-4


def test_prefix_cache_hits_equal_cold_runs(next_path):
    rng = np.random.default_rng(1)
    system = ids(rng, 48)
    prompts = {
        "on_boundary": ids(rng, 32),
        "off_boundary": ids(rng, 37),
        "shared_system_a": system + ids(rng, 9),
        "shared_system_b": system + ids(rng, 21),
        "long_chunked": ids(rng, 150),        # > max_num_batched_tokens: chunked prefill
    }
    cold = qnext.LLM(next_path, enable_prefix_caching=False, **ENGINE)
    warm = qnext.LLM(next_path, **ENGINE)
    batch = [{"prompt_token_ids": p} for p in prompts.values()]
    expected = cold.generate(batch, GREEDY_LOGPROBS)
    first = warm.generate(batch, GREEDY_LOGPROBS)
    assert_same(first, expected)
    # Identical prompts again (and the shared-system siblings): served from cache, same outputs.
    again = warm.generate(batch, GREEDY_LOGPROBS)
    assert_same(again, expected)
    cached = {name: out.num_cached_tokens for name, out in zip(prompts, again)}
    for name, p in prompts.items():
        assert cached[name] == (len(p) - 1) // 16 * 16, (name, cached)
    assert all(o.num_cached_tokens == 0 for o in expected)


def test_multi_turn_chat_reuses_previous_turn(next_path):
    rng = np.random.default_rng(2)
    cold = qnext.LLM(next_path, enable_prefix_caching=False, **ENGINE)
    warm = qnext.LLM(next_path, **ENGINE)
    history = ids(rng, 21)
    previous_computed = 0
    for turn in range(3):
        prompt = {"prompt_token_ids": history}
        expected = cold.generate(prompt, GREEDY_LOGPROBS)
        got = warm.generate(prompt, GREEDY_LOGPROBS)
        assert_same(got, expected)
        if turn > 0:
            # everything the previous turn computed (prompt + output but its last token), floored to a block
            assert got[0].num_cached_tokens == previous_computed // 16 * 16 > 0
        previous_computed = len(history) + GREEDY_LOGPROBS.max_tokens - 1
        history = history + got[0].outputs[0].token_ids + ids(rng, 7 + 5 * turn)


def test_partial_kv_eviction_keeps_outputs_exact(next_path):
    """The seed's scenario: enough other traffic to evict part of a conversation's KV blocks."""
    rng = np.random.default_rng(3)
    cold = qnext.LLM(next_path, enable_prefix_caching=False, **ENGINE)
    warm = qnext.LLM(next_path, **ENGINE)
    conversation = ids(rng, 90)
    prompt = {"prompt_token_ids": conversation}
    assert_same(warm.generate(prompt, GREEDY_LOGPROBS), cold.generate(prompt, GREEDY_LOGPROBS))
    for _ in range(4):                                     # other traffic
        other = [{"prompt_token_ids": ids(rng, 80)} for _ in range(2)]
        warm.generate(other, GREEDY)
    stats = warm.engine.cache_stats
    assert stats.kv_blocks_evicted > 0
    follow_up = {"prompt_token_ids": conversation + ids(rng, 10)}
    assert_same(warm.generate(follow_up, GREEDY_LOGPROBS), cold.generate(follow_up, GREEDY_LOGPROBS))


def test_batch_equals_solo_and_survives_preemption(next_path):
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": ids(rng, n)} for n in (12, 45, 30, 60)]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=100, ignore_eos=True)
    roomy = qnext.LLM(next_path, **ENGINE)                 # solo runs fit; the batch of four preempts here too
    solo = [roomy.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert tokens_of(roomy.generate(prompts, params)) == solo
    tight = qnext.LLM(next_path, **dict(ENGINE, enable_prefix_caching=False))   # 32 blocks < the batch's 36
    assert tokens_of(tight.generate(prompts, params)) == solo
    assert tight.engine.scheduler.num_preemptions > 0


def test_bad_input_is_rejected_and_engine_keeps_serving(next_path, tmp_path):
    llm = qnext.LLM(next_path, **ENGINE)
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 300}, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([good, {"prompt_token_ids": [5, 100000]}], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(good, SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="config.json"):
        qnext.LLM(tmp_path)
    # An in-flight request is unaffected by a rejected one.
    llm.engine.add_request("inflight", good, GREEDY)
    with pytest.raises(ValueError):
        llm.engine.add_request("bad", {"prompt_token_ids": [-1]}, GREEDY)
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            done[out.request_id] = out
    assert len(done["inflight"].outputs[0].token_ids) == GREEDY.max_tokens
    assert tokens_of(llm.generate(good, GREEDY)) == [done["inflight"].outputs[0].token_ids]


def test_abort_frees_the_request(next_path):
    llm = qnext.LLM(next_path, **ENGINE)
    llm.engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=50))
    llm.engine.step()
    out = llm.engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.cache.num_free_slots == ENGINE["max_num_seqs"]


def test_plain_greedy_batches_skip_the_sampler_with_the_same_tokens(next_path, monkeypatch):
    """Greedy rows without logprobs, penalties or suppressed ids take the step's own argmax; forcing every batch
    through the sampler gives the same tokens, and the fast path really skips it."""
    import qnext.engine.runner as runner_module
    from qnext.engine.sampling_inputs import SamplerInputBuilder

    rng = np.random.default_rng(8)
    batch = [{"prompt_token_ids": ids(rng, n)} for n in (9, 30, 51)]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3), GREEDY]   # eos held back
    calls = []
    sample_rows = runner_module._sample_rows
    monkeypatch.setattr(runner_module, "_sample_rows", lambda *a, **k: calls.append(1) or sample_rows(*a, **k))
    llm = qnext.LLM(next_path, **ENGINE)
    fast = llm.generate(batch, params)
    fast_calls = len(calls)
    monkeypatch.setattr(SamplerInputBuilder, "plain_greedy", lambda self, rows: False)
    slow = llm.generate(batch, params)
    assert tokens_of(fast) == tokens_of(slow)
    steps_with_rows = len(calls) - fast_calls
    assert 0 < fast_calls < steps_with_rows    # min_tokens rows sample while their eos is held back, then not


def test_in_place_state_rows_match_batched_rows(next_path, monkeypatch):
    """Real-size state rows (1 MiB) take the decode path that updates rows in place, one (row, head) block at a
    time; the tiny test states take the batched one. With the size threshold at 0 the tiny model runs the in-place
    path through an engine (decode captures, restores, several turns): same tokens and logprobs as batched."""
    import jax

    import pallas_kernels.gated_delta_rule as gdr
    from qnext.engine.runner import make_engine_step

    rng = np.random.default_rng(5)
    turns = [[ids(rng, 21), ids(rng, 40)]]
    cold = qnext.LLM(next_path, enable_prefix_caching=False, **ENGINE)       # the batched path
    expected = []
    for turn in range(2):
        batch = [{"prompt_token_ids": h} for h in turns[-1]]
        expected.append(cold.generate(batch, GREEDY_LOGPROBS))
        turns.append([h + o.outputs[0].token_ids + ids(rng, 9) for h, o in zip(turns[-1], expected[-1])])

    make_engine_step.cache_clear()                     # the step is traced again, under the patched threshold
    jax.clear_caches()
    monkeypatch.setattr(gdr, "_IN_PLACE_ROW_BYTES", 0)
    try:
        warm = qnext.LLM(next_path, **ENGINE)
        for turn in range(2):
            got = warm.generate([{"prompt_token_ids": h} for h in turns[turn]], GREEDY_LOGPROBS)
            assert_same(got, expected[turn])
        assert warm.engine.cache_stats.snapshots_restored > 0
    finally:
        make_engine_step.cache_clear()                 # later tests trace the default path again
        jax.clear_caches()
