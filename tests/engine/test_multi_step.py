"""Several decode steps per jitted call (num_scheduler_steps) give what one step a call gives: the same tokens
(greedy and seeded sampling), stops, finish reasons, prefix-cache reuse and snapshot captures."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import qnext
from qnext import SamplingParams

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=160, block_size=16,
              num_gpu_blocks_override=40, max_num_snapshots=8)
STEPS = 4


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5")


def finished(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].text)
            for o in outs]


def count_calls(llm, name):
    calls = []
    method = getattr(llm.engine.runner, name)

    def counted(*a, **kw):
        calls.append(1)
        return method(*a, **kw)
    setattr(llm.engine.runner, name, counted)
    return calls


def test_multi_step_tokens_and_stops_match_single_steps(path):
    single = qnext.LLM(path, **ENGINE)
    multi = qnext.LLM(path, num_scheduler_steps=STEPS, **ENGINE)
    multi.engine.warm_up()
    prompts = ["Once upon a time", "the quick brown fox " * 3, "x", "a lighthouse keeper wrote"]
    base = single.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in base]
    params = [
        # a stop token id mid-window (the device stops the row; the host keeps nothing after it)
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[tokens[0][6]]),
        # EOS stops unless ignored; max_tokens not a multiple of the steps per call
        SamplingParams(temperature=0.0, max_tokens=19),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        # before min_tokens a stop token id does not stop
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, min_tokens=6, stop_token_ids=[tokens[3][1]]),
    ]
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    calls = count_calls(multi, "_execute_window")
    expected = finished(single.generate(prompts, params))
    steps_before = multi.engine.stats.num_steps
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        got = finished(multi.generate(prompts, params))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert got == expected
    assert compiles == []                                   # warm-up compiled the multi-step calls too
    assert expected[0][1:3] == ("stop", tokens[0][6]) and len(expected[0][0]) == tokens[0].index(tokens[0][6]) + 1
    assert len(expected[2][0]) == 7
    assert len(expected[3][0]) > 6
    assert calls                                             # decode ran multi-step, in fewer engine steps
    single_steps = sum(len(e[0]) for e in expected)
    assert multi.engine.stats.num_steps - steps_before < single_steps // 2

    # seeded sampling (temperature, top-k / top-p, min-p) draws on device the tokens single steps draw
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=11, seed=5),
               SamplingParams(temperature=1.2, top_k=20, max_tokens=9, seed=6, ignore_eos=True),
               SamplingParams(temperature=0.7, min_p=0.05, max_tokens=10, seed=7),
               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    calls.clear()
    got, want = multi.generate(prompts, sampled), single.generate(prompts, sampled)
    assert finished(got) == finished(want)
    assert calls
    # rows the device cannot decide alone (logprobs, penalties) take single steps: same results
    host_side = [SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True),
                 SamplingParams(temperature=0.9, max_tokens=9, seed=3, repetition_penalty=1.3)]
    calls.clear()
    got, want = multi.generate(prompts[:2], host_side), single.generate(prompts[:2], host_side)
    assert finished(got) == finished(want)
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
    assert not calls
    # stop strings run multi-step: the host appends a call's tokens one at a time and drops those after the stop
    texts = [o.outputs[0].text for o in base]
    stops = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[letters_in(t, i)])
             for i, t in enumerate(texts)]
    got, want = multi.generate(prompts, stops), single.generate(prompts, stops)
    assert finished(got) == finished(want)
    assert sum(o.outputs[0].finish_reason == "stop" for o in want) >= 3 and calls


def letters_in(text: str, i: int) -> str:
    """Two letters of `text` from about a third of the way on: a stop string met mid-output."""
    start = len(text) // 3 + i
    return next(text[j:j + 2] for j in range(start, len(text) - 1) if text[j:j + 2].isalpha())


def window_reaches_boundary(prompt_len, j):
    """Output j (appended when prompt_len + j tokens are computed) comes from a call whose window of STEPS tokens
    reaches the next block boundary."""
    computed = prompt_len + j
    window_end = prompt_len + (j - 1) // STEPS * STEPS + STEPS
    return computed % 16 and (computed // 16 + 1) * 16 <= window_end


@pytest.mark.parametrize("snapshots", ["auto", "bfloat16"], ids=["float32_snapshots", "bf16_snapshot_pool"])
def test_multi_step_chat_reuses_like_single_steps(path, snapshots):
    """Turn ends at varied offsets from block boundaries: the decode tracking snapshot the next turn restores is
    the same. One turn stops on a stop token id 1-3 tokens before a block boundary, inside a call's window: the
    device must stop that row there, or it would overwrite the tracking snapshot with a state past the stop.
    With a bf16 device snapshot pool the window's captures and restores go through it (the same rounding both
    ways: single and multi-step equal)."""
    single = qnext.LLM(path, mamba_ssm_cache_dtype=snapshots, **ENGINE)
    multi = qnext.LLM(path, num_scheduler_steps=STEPS, mamba_ssm_cache_dtype=snapshots, **ENGINE)
    assert bool(multi.engine.scheduler.cache.buffers.snapshot_recurrent) == (snapshots == "bfloat16")
    probe = qnext.LLM(path, enable_prefix_caching=False, **ENGINE)
    rng = np.random.default_rng(4)
    history = rng.integers(3, 500, 22).tolist()
    stopped_early = False
    for turn, max_tokens in enumerate((12, 9, 40, 14, 3)):
        prompt = {"prompt_token_ids": history}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if turn == 2:
            out = probe.generate(prompt, params)[0].outputs[0].token_ids
            # output j stops the turn with len(history) + j tokens computed, in a call whose window (decode calls
            # start at len(history), STEPS tokens each) runs on to a block boundary, past one the decode crossed
            # (so the tracking snapshot, not the prompt's, is what the next turn restores)
            j = next(j for j, t in enumerate(out) if t not in out[:j] and j >= 1
                     and window_reaches_boundary(len(history), j) and (len(history) + j) // 16 * 16 > len(history))
            params = dataclasses.replace(params, stop_token_ids=[out[j]])
            stop_computed = len(history) + j
        want, got = single.generate(prompt, params)[0], multi.generate(prompt, params)[0]
        assert finished([got]) == finished([want])
        assert got.num_cached_tokens == want.num_cached_tokens
        if turn:
            assert got.num_cached_tokens > 0
        if turn == 3:                  # the stopped turn's end-of-turn snapshot, at its last boundary
            assert got.num_cached_tokens == stop_computed // 16 * 16
            stopped_early = True
        history = history + got.outputs[0].token_ids + rng.integers(3, 500, 5 + 3 * turn).tolist()
    assert stopped_early
    stats = [dataclasses.asdict(llm.engine.cache_stats) for llm in (single, multi)]
    for key in ("reused_tokens", "lost_to_missing_state_tokens", "snapshots_captured", "snapshots_restored"):
        assert stats[1][key] == stats[0][key], key


def test_multi_step_stop_strings_keep_the_snapshots_single_steps_keep(path):
    """Stop strings end turns at many offsets from block boundaries. A call's window that runs on past the stop
    (tokens the host drops) must not overwrite the decode tracking snapshot with a state past them, so the next
    turn reuses as many tokens as after single steps, and equals it."""
    options = dict(ENGINE, block_size=8, num_gpu_blocks_override=120, max_num_snapshots=64)
    single, multi = qnext.LLM(path, **options), qnext.LLM(path, num_scheduler_steps=STEPS, **options)
    rng = np.random.default_rng(6)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in range(11, 19)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [o.outputs[0].text for o in single.generate(prompts, greedy)]
    assert finished(multi.generate(prompts, greedy)) == finished(single.generate(prompts, greedy))  # same history
    stops = [dataclasses.replace(greedy, stop=[letters_in(t, i)]) for i, t in enumerate(texts)]
    want, got = single.generate(prompts, stops), multi.generate(prompts, stops)
    assert finished(got) == finished(want)
    assert sum(o.outputs[0].finish_reason == "stop" for o in want) >= 6
    turn = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids + [7, 8, 9]}
            for p, o in zip(prompts, want)]
    want, got = single.generate(turn, greedy), multi.generate(turn, greedy)
    assert finished(got) == finished(want)
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]


def test_multi_step_with_too_few_blocks_matches_a_roomy_engine(path):
    """Rows run fewer steps when the cache has no blocks for more (never preempting for them); preemption by
    the scheduler still works."""
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in (30, 25, 33, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True)
    roomy = qnext.LLM(path, **ENGINE)
    tight = qnext.LLM(path, num_scheduler_steps=STEPS, **dict(ENGINE, num_gpu_blocks_override=12))
    want = finished(roomy.generate(prompts, params))
    got = finished(tight.generate(prompts, params))
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0


def test_multi_step_streams_the_same_text_in_fewer_pieces(path):
    single = qnext.LLM(path, **ENGINE)
    multi = qnext.LLM(path, num_scheduler_steps=STEPS, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    full = single.generate("Stream me", params)[0].outputs[0]
    deltas = [delta for delta, _ in multi.stream("Stream me", params)]
    assert "".join(deltas) == full.text
    assert len(deltas) == 1 + -(-12 // STEPS)         # the prefill's token, then STEPS tokens a call


def test_num_scheduler_steps_is_validated(path):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        qnext.LLM(path, num_scheduler_steps=0, **ENGINE)
