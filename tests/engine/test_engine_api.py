"""The user-facing API on a tiny checkpoint with a real tokenizer: text prompts, chat, stop conditions,
streaming, logprobs, seeds, and no compilation after warm-up."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import qnext
from qnext import SamplingParams
from qnext.engine.stats import compilations
from qnext.testing.tiny_tokenizer import tiny_eos_token_id

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=160, block_size=16,
              num_gpu_blocks_override=40, max_num_snapshots=8)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return qnext.LLM(tiny_checkpoint("qwen3_5"), **ENGINE)


def test_warm_up_then_mixed_workload_compiles_nothing(llm):
    # the engine's first steps (this module's first test), then the same shapes on other tokens: nothing compiles
    # again (params and cache buffers start committed to the device, as every step leaves them)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(3, 23))}, params)
    start = compilations()
    llm.generate({"prompt_token_ids": list(range(30, 50))}, params)
    assert compilations() == start, "the first shape compiled again on its second call"
    llm.engine.warm_up()
    start = compilations()
    llm.engine.warm_up()
    assert compilations() == start, "a second warm-up compiled"
    prompts = ["hello there", "a much longer prompt " * 6, "x", "the quick brown fox jumps over the lazy dog"]
    start = compilations()
    before = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in (3, 9, 1, 17)])
    llm.generate(prompts[:2], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, seed=1))
    llm.generate(prompts[:3], SamplingParams(max_tokens=4, seed=2))     # the APIs' default: temperature 1, top_p 1
    assert compilations() == start, "the workload compiled after warm-up"
    # the same weights as host arrays: update_weights compiles its copy for them, then the steps compile nothing
    llm.engine.update_weights(jax.tree.map(np.asarray, llm.engine.runner.params))
    start = compilations()
    after = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in (3, 9, 1, 17)])
    assert compilations() == start, "a step compiled after update_weights"
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_text_prompt_and_chat(llm):
    out = llm.generate("Hello, world!", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("Hello, world!")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    messages = [{"role": "user", "content": "What is a lighthouse?"}]
    chat = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert chat.prompt_token_ids == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    assert len(chat.outputs[0].token_ids) == 5


def test_stop_token_and_stop_string(llm):
    base = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    tokens = base.outputs[0].token_ids
    stop_id = tokens[4]
    out = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                          stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    text = base.outputs[0].text
    # a 2-character stop string whose first occurrence is past the first third of the text
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 1)
                if len(text[i:i + 2].strip()) == 2 and text.index(text[i:i + 2]) == i)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                          stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]


def test_eos_finishes_unless_ignored(llm):
    eos = tiny_eos_token_id(llm.engine.model_config.vocab_size)
    assert eos in llm.engine.model_config.eos_token_ids
    out = llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_streaming_yields_the_same_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    full = llm.generate("Stream me", params)[0].outputs[0]
    deltas = [delta for delta, _ in llm.stream("Stream me", params)]
    assert "".join(deltas) == full.text
    assert len(deltas) == len(full.token_ids)


def test_logprobs_and_seeds(llm):
    params = SamplingParams(temperature=0.9, max_tokens=6, logprobs=3, seed=42, ignore_eos=True)
    a = llm.generate("seeded", params)[0].outputs[0]
    b = llm.generate(["other prompt first", "seeded"], params)[1].outputs[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == 6
    for token, entry in zip(a.token_ids, a.logprobs):
        assert token in entry and len(entry) >= 3
        ranks = sorted(lp.rank for t, lp in entry.items() if t != token or lp.rank <= 3)
        assert ranks[:3] == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert a.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(a.token_ids, a.logprobs)))


def test_prefill_and_mixed_steps_pad_to_halfway_sizes(tiny_checkpoint):
    """A step of 40 tokens pads to the 48-token shape whether or not decode rows ride along (not to 64)."""
    from qnext.model.step_inputs import Segment

    engine = qnext.LLM(tiny_checkpoint("qwen3_5"), **dict(ENGINE, max_num_batched_tokens=64)).engine
    decode_rows = [Segment([7], 20, [1, 2], i + 1, i + 1) for i in range(2)]
    prompt_tail = [Segment([7] * 38, 0, [3, 4, 5], -1, 3)]
    for segments in (prompt_tail, decode_rows + prompt_tail):
        sizes = engine.runner.buckets.bucket_for(segments).sizes
        assert sizes.num_tokens == 48
        assert (sizes.num_decode > 0) == (len(segments) == 3)      # the mixed family only when decode rows come
    assert engine.runner.buckets.bucket_for(decode_rows).sizes.num_tokens == 2      # decode-only: rows, not tokens


def test_big_step_budgets_add_quarter_sizes(tiny_checkpoint):
    """From 256 tokens on the prefill shapes also come in 1.25x and 1.75x powers of two (no compilation here:
    bucket_for only lays shapes out)."""
    from qnext.model.step_inputs import Segment

    path = tiny_checkpoint("qwen3_5", max_position_embeddings=2048)
    engine = qnext.LLM(path, **dict(ENGINE, max_num_batched_tokens=1024, max_model_len=1040,
                                    num_gpu_blocks_override=70)).engine
    sizes = sorted({b.sizes.num_tokens for b in engine.runner.buckets.prefill})
    assert sizes == [16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    prompt = [Segment([7] * 850, 0, list(range(1, 55)), -1, 1)]
    assert engine.runner.buckets.bucket_for(prompt).sizes.num_tokens == 896


def test_engine_is_freed_without_the_cyclic_gc(tiny_checkpoint):
    """Front ends may move the start-up heap out of the cyclic GC's reach (freeze_startup_heap: per-step
    collections stay cheap); that is only safe because a dropped engine is freed by reference counting alone: no
    cycle keeps its buffers alive. The constructor itself freezes nothing."""
    import gc
    import weakref

    gc.unfreeze()
    llm = qnext.LLM(tiny_checkpoint("qwen3_5"), **ENGINE)
    assert gc.get_freeze_count() == 0
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=3))
    refs = [weakref.ref(x) for x in (llm.engine, llm.engine.runner, llm.engine.scheduler.cache,
                                     llm.engine.scheduler.cache.buffers)]
    gc.disable()
    try:
        del llm
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
