"""Parallel sampling (n > 1): one admission and one prefill per request, forks that share the prompt's KV blocks
and copy its state row, each sample with its own seed stream; samples that finish, are preempted or aborted leave
the others as they would have been; nothing leaks."""
from __future__ import annotations

import pytest

from qnext import LLM, SamplingParams

PROMPT = {"prompt_token_ids": list(range(3, 24))}       # 21 tokens: two full blocks of 8 and a partial one
OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=8)


def seeded(seed: int, n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, max_tokens=16, seed=seed, logprobs=2, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("qwen3_5"), enable_prefix_caching=False, **OPTIONS)


def resources(llm) -> tuple[int, int, int]:
    cm = llm.engine.scheduler.cache
    return cm.num_free_blocks, cm.num_free_slots, cm.blocks.num_used


def test_greedy_samples_are_equal_and_the_prompt_is_prefilled_once(llm):
    before, prefilled = resources(llm), llm.engine.stats.num_prefill_tokens
    out = llm.generate(PROMPT, SamplingParams(n=4, temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert llm.engine.stats.num_prefill_tokens - prefilled == len(PROMPT["prompt_token_ids"])
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    alone = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert all(c.token_ids == alone.outputs[0].token_ids for c in out.outputs)
    assert resources(llm) == before and before[2] == 0


def test_seeded_samples_equal_single_requests_with_seed_plus_index(llm):
    before = resources(llm)
    group = llm.generate(PROMPT, seeded(7, n=4))[0]
    singles = llm.generate([PROMPT] * 4, [seeded(7 + i) for i in range(4)])
    for sample, single in zip(group.outputs, singles):
        alone = single.outputs[0]
        assert sample.token_ids == alone.token_ids
        for got, want in zip(sample.logprobs, alone.logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1             # the seeds differ, so do the samples
    assert resources(llm) == before


def test_a_sample_that_stops_early_leaves_the_others_intact(llm):
    free = llm.generate(PROMPT, seeded(11, n=4))[0].outputs
    stop = free[1].token_ids[2]                                  # sample 1 stops at its third token
    stopped = llm.generate(PROMPT, seeded(11, n=4, stop_token_ids=[stop]))[0].outputs
    for a, b in zip(free, stopped):
        cut = a.token_ids.index(stop) + 1 if stop in a.token_ids else len(a.token_ids)
        assert b.token_ids == a.token_ids[:cut]
    assert len(stopped[1].token_ids) == 3 and stopped[1].finish_reason == "stop"


def test_samples_that_finish_with_their_first_token_free_everything(llm):
    before = resources(llm)
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=1))[0]
    assert [len(c.token_ids) for c in out.outputs] == [1, 1, 1]
    assert resources(llm) == before


def test_aborting_one_sample_leaves_the_others_intact(llm):
    want = llm.generate(PROMPT, seeded(5, n=3))[0].outputs
    engine, before = llm.engine, resources(llm)
    engine.add_request("r", PROMPT, seeded(5, n=3))
    for _ in range(4):
        engine.step()
    group = engine.requests["r"].group
    engine.scheduler.abort(group[1])
    engine.runner.free(group[1].request_id)
    while engine.has_unfinished_requests():
        outs = engine.step()
    out = outs[-1]
    engine.release("r")
    assert out.finished and out.outputs[1].finish_reason == "abort"
    assert [out.outputs[i].token_ids for i in (0, 2)] == [want[i].token_ids for i in (0, 2)]
    assert resources(llm) == before


def test_prefix_cache_hit_and_preempted_samples_continue_as_before(tiny_checkpoint):
    """With prefix caching on, a second n=4 request of the prompt hits the cache and samples the same; a KV cache
    too small for all four samples at once preempts the newest (recomputed later from the prefix cache) and every
    sample still equals the run with room to spare."""
    want = None
    for blocks in (None, 10):
        llm = LLM(tiny_checkpoint("qwen3_5"), num_gpu_blocks_override=blocks, **{**OPTIONS, "max_model_len": 64})
        out = llm.generate(PROMPT, SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=3, ignore_eos=True))[0]
        tokens = [c.token_ids for c in out.outputs]
        if want is None:
            want = tokens
            admissions = llm.engine.cache_stats.admissions
            again = llm.generate(PROMPT, SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=3,
                                                        ignore_eos=True))[0]
            assert again.num_cached_tokens > 0                        # the prompt was published (once) ...
            assert llm.engine.cache_stats.admissions == admissions + 1    # ... and a group is one admission
            assert [c.token_ids for c in again.outputs] == want
        else:
            assert llm.engine.scheduler.num_preemptions > 0
            assert tokens == want
        cm = llm.engine.scheduler.cache
        assert cm.blocks.num_used == 0 and cm.num_free_slots == OPTIONS["max_num_seqs"]


def test_stream_yields_each_samples_text(llm):
    deltas, last = ["", ""], None
    for delta, out in llm.stream(PROMPT, SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=6)):
        assert isinstance(delta, list) and len(delta) == 2
        deltas = [a + b for a, b in zip(deltas, delta)]
        last = out
    assert last.finished and deltas == [c.text for c in last.outputs]


def test_n_larger_than_max_num_seqs_is_refused(llm):
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate(PROMPT, SamplingParams(n=9))


def test_samples_equal_with_several_decode_steps_per_call(llm, tiny_checkpoint):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=21, ignore_eos=True)
    want = [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs]
    multi = LLM(tiny_checkpoint("qwen3_5"), enable_prefix_caching=False, num_scheduler_steps=4, **OPTIONS)
    assert [c.token_ids for c in multi.generate(PROMPT, params)[0].outputs] == want
