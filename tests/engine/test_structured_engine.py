"""Structured outputs through the engine on the tiny random checkpoint: at temperature 1 over many seeds every
output is a full match of its constraint; start_after frees the output until its trigger; constrained rows leave
their unconstrained neighbours' tokens alone; bad specs are ValueErrors at add_request; a dead end ends the request;
preemption (recompute) keeps the matcher in step with the output."""
from __future__ import annotations

import json
import re

import pytest

import qnext
from qnext import SamplingParams, StructuredOutputsParams
from qnext.structured import DEAD_END

jsonschema = pytest.importorskip("jsonschema")

# The shapes of test_engine_api / test_multi_step, so the modules share compilations.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=160, block_size=16,
              num_gpu_blocks_override=40, max_num_snapshots=8)
SEEDS = range(12)
PROMPT = "Answer in JSON:"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{3}(\.[a-z]{1,3})?"
LARK = 'start: expr\nexpr: term | term "+" term | term "+" term "+" term\nterm: /[0-9]{1,3}/'
GBNF = 'root ::= term ("*" term)?\nterm ::= [0-9] [0-9]?'


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return qnext.LLM(tiny_checkpoint("qwen3_5"), **ENGINE)


def run(llm, spec: dict, seeds=SEEDS, prompt=PROMPT, **params):
    params.setdefault("max_tokens", 150)
    outs = llm.generate([prompt] * len(seeds), [
        SamplingParams(temperature=1.0, seed=s, structured_outputs=StructuredOutputsParams(**spec), **params)
        for s in seeds])
    return [o.outputs[0] for o in outs]


def test_json_schema_outputs_validate(llm):
    outs = run(llm, dict(json=SCHEMA))
    for o in outs:
        assert o.finish_reason == "stop" and o.stop_reason is None, (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > len(outs) // 2, "the seeds do not sample different outputs"
    assert llm.engine.stats.num_structured_masks > 0


def test_json_object_outputs_are_objects(llm):
    # any object: its strings are unbounded, so random weights may run out of tokens inside one ("length"); such
    # an output is still a prefix the grammar accepts
    outs = run(llm, dict(json_object=True), seeds=range(8))
    compiler = llm.engine.grammar_compiler()
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict), o.text
        else:
            assert o.finish_reason == "length" and o.text.startswith("{")
            matcher = compiler.compile(StructuredOutputsParams(json_object=True))
            assert matcher.consume_tokens(o.token_ids) and not matcher.is_error()
    assert sum(o.finish_reason == "stop" for o in outs) >= 2, "no object was completed"


def test_regex_choice_and_grammars_match(llm):
    for o in run(llm, dict(regex=REGEX)):
        assert re.fullmatch(REGEX, o.text), o.text
    choices = ["red", "green", "blue", "light blue"]
    picked = [o.text for o in run(llm, dict(choice=choices))]
    assert set(picked) <= set(choices) and len(set(picked)) > 1, picked
    for o in run(llm, dict(grammar=LARK)):
        assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3}){0,2}", o.text), o.text
    for o in run(llm, dict(grammar=GBNF), seeds=range(6)):           # GBNF, converted by llguidance
        assert re.fullmatch(r"[0-9]{1,2}(\*[0-9]{1,2})?", o.text), o.text


def test_start_after_frees_the_output_until_the_trigger(llm):
    seeds = range(4)
    free = [o.token_ids for o in llm.generate([PROMPT] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=8,
                                                                             ignore_eos=True) for s in seeds])
            for o in [o.outputs[0]]]
    tok = llm.get_tokenizer()
    for s, tokens in zip(seeds, free):
        trigger = tokens[2:4]                 # a two-token sequence the free run emits at output positions 2-3
        end = next(i + 2 for i in range(len(tokens) - 1) if tokens[i:i + 2] == trigger)
        out = run(llm, dict(regex="[0-9]{2,4}", start_after=trigger), seeds=[s], ignore_eos=True, max_tokens=40)[0]
        # the same seed draws the same tokens until the trigger (no mask yet), then only digits
        assert out.token_ids[:end] == tokens[:end]
        constrained = out.token_ids[end:]
        if constrained[-1] in llm.engine.model_config.eos_token_ids:      # the eos that ended it, not text
            constrained = constrained[:-1]
        assert re.fullmatch("[0-9]{2,4}", tok.decode(constrained)), out.text
        assert out.finish_reason == "stop"


def test_unconstrained_neighbours_keep_their_tokens(llm):
    prompts = ["Once upon a time", "the quick brown fox", "x"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=140,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate(prompts + [PROMPT], [greedy] * 3 + [constrained])
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    jsonschema.validate(json.loads(outs[3].outputs[0].text), SCHEMA)


def test_invalid_specs_are_rejected_at_add_request_and_the_engine_keeps_serving(llm):
    engine = llm.engine
    engine.add_request("inflight", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=40, seed=1, structured_outputs=StructuredOutputsParams(regex=REGEX)))
    for spec, message in [(dict(json={"type": "frob"}), "json is invalid"), (dict(regex="[a-"), "regex is invalid"),
                          (dict(grammar="start: nothing"), "grammar is invalid")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", {"prompt_token_ids": [5]},
                               SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
        assert "bad" not in engine.requests
    done = {}
    for _ in range(100):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    engine.release("inflight")
    assert re.fullmatch(REGEX, done["inflight"].outputs[0].text)


def test_compiled_grammars_and_cached_prefixes_are_reused(llm):
    compiler = llm.engine.grammar_compiler()
    prompt = "a long shared system prompt for a structured answer " * 3
    run(llm, dict(regex="[0-9]{3}"), seeds=range(2), prompt=prompt, max_tokens=8)
    before = compiler.num_compiled
    again = llm.generate(prompt, SamplingParams(seed=9, max_tokens=8,
                                                structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")))[0]
    assert compiler.num_compiled == before
    assert again.num_cached_tokens >= 16, "a constrained request's prompt missed the prefix cache"


def test_dead_end_finishes_the_request(llm):
    # the grammar allows only the empty output (eos), which min_tokens suppresses: no token is allowed
    out = run(llm, dict(grammar='start: ""'), seeds=[0], min_tokens=2, max_tokens=10)[0]
    assert out.finish_reason == DEAD_END and "dead end" in out.stop_reason and out.token_ids == []
    # without min_tokens the same grammar ends at once with eos
    out = run(llm, dict(grammar='start: ""'), seeds=[0], max_tokens=10)[0]
    assert out.finish_reason == "stop" and out.text == ""


def test_preemption_keeps_the_matcher_in_step(llm):
    """Requests preempted mid-output recompute their tokens and keep their matchers: the same tokens as alone,
    and still full matches. Each needs 10 of the cache's 39 usable blocks: alone they fit, four at once do not."""
    regex = r"([0-9]-){47,48}[0-9]"
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=99,
                             structured_outputs=StructuredOutputsParams(regex=regex)) for s in range(4)]
    prompts = [{"prompt_token_ids": list(range(10 + 7 * i, 70 + 7 * i))} for i in range(4)]
    solo = [llm.generate(p, q)[0].outputs[0] for p, q in zip(prompts, params)]
    preemptions = llm.engine.scheduler.num_preemptions
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > preemptions
    assert [o.token_ids for o in outs] == [o.token_ids for o in solo]
    for o in outs:
        assert re.fullmatch(regex, o.text) and o.finish_reason == "stop", o.text


def test_multi_step_engine_single_steps_only_batches_with_constrained_rows(tiny_checkpoint):
    llm = qnext.LLM(tiny_checkpoint("qwen3_5"), num_scheduler_steps=4, **ENGINE)
    llm.generate(["hello there"] * 2, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stats = llm.engine.stats
    assert stats.num_model_steps > stats.num_steps, "unconstrained rows stopped taking several steps a call"
    steps, model_steps = stats.num_steps, stats.num_model_steps
    # the unconstrained row ends first, so every step of this batch has the constrained row
    free = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(regex="[0-9]{16,20}"))
    outs = llm.generate(["hello there", "x"], [free, constrained])
    assert stats.num_model_steps - model_steps == stats.num_steps - steps, "a constrained batch ran several steps"
    assert re.fullmatch("[0-9]{16,20}", outs[1].outputs[0].text)
