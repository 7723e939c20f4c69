"""thinking_token_budget: a prompt that leaves the model inside `<think>` gets at most `budget` free output tokens
before the engine forces `</think>`; a grammar with start_after `</think>` then applies; a prompt outside reasoning
is not affected. On random weights `</think>` is one token of 512, so without the budget the model rarely closes
its reasoning within a few dozen tokens: the forcing is what the test sees."""
from __future__ import annotations

import json

import pytest

import qnext
from qnext import SamplingParams, StructuredOutputsParams
from qnext.structured.thinking_budget import ThinkingBudget, prompt_inside_reasoning

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=160, block_size=16,
              num_gpu_blocks_override=40, max_num_snapshots=8)
SEEDS = range(8)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return qnext.LLM(tiny_checkpoint("qwen3_5"), **ENGINE)


def think_ids(llm):
    tok = llm.engine.tokenizer
    return tok.token_to_id("<think>"), tok.token_to_id("</think>")


def test_budget_forces_the_end_of_reasoning(llm):
    start, end = think_ids(llm)
    prompt = {"prompt_token_ids": llm.engine.tokenizer.encode("Hello <think>\n")}
    assert prompt_inside_reasoning(prompt["prompt_token_ids"], start, end)
    for budget in (0, 5):
        outs = llm.generate([prompt] * len(SEEDS), [
            SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, thinking_token_budget=budget)
            for s in SEEDS])
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            assert end in ids[:budget + 1], (budget, ids)
            assert len(ids) == 12                      # the output goes on after the forced end
    plain = llm.generate([prompt] * len(SEEDS), [
        SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in SEEDS])
    assert sum(end in o.outputs[0].token_ids for o in plain) < len(SEEDS) // 2, "random weights close on their own"


def test_budget_is_a_no_op_outside_reasoning(llm):
    prompt = "Hello <think>\nhmm</think>\n\nthe answer"
    a = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    b = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                              thinking_token_budget=0))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_grammar_starts_after_the_forced_end(llm):
    _, end = think_ids(llm)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    spec = StructuredOutputsParams(json=schema, start_after=[end])
    outs = llm.generate(["Hi <think>\n"] * 4, [
        SamplingParams(temperature=1.0, seed=s, max_tokens=60, thinking_token_budget=3, structured_outputs=spec)
        for s in range(4)])
    for o in outs:
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", text
        after = text.split("</think>", 1)[1] if "</think>" in text else None
        assert after is not None, text
        assert json.loads(after)["n"] in range(100)


def test_multi_token_end_sequence_is_continued():
    b = ThinkingBudget(2, [7, 8, 9], inside=True)
    for t in (1, 2):
        assert b.forced_token is None
        b.advance(t)
    assert b.forced_token == 7
    b.advance(7)
    assert b.forced_token == 8
    b.advance(8)
    assert b.forced_token == 9
    b.advance(9)
    assert b.forced_token is None and not b.inside


def test_bad_budget_is_a_value_error():
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
