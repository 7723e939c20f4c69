"""Grammar fast-forward (engine option grammar_fast_forward, on by default): tokens a grammar forces are drafted and
verified in one window, each position masked by the grammar after the drafts before it. Greedy and seeded sampled
tokens equal plain decoding's (grammar_fast_forward=False) for a JSON schema, forced tool calls (a named function and
tool_choice required) and a regex, logprobs within float noise; forced calls take fewer engine steps; the masks of a
window equal the masks plain decoding computes token by token; fast-forward beside suffix drafting."""
from __future__ import annotations

import numpy as np
import pytest

from qnext import LLM, SamplingParams
from qnext.agents.tool_grammar import tool_call_grammar
from qnext.engine.config import EngineConfig
from qnext.sampling_params import StructuredOutputsParams
from qnext.structured import GrammarCompiler, StructuredState, fill_bitmask
from qnext.structured.matcher import fill_window_bitmask

OPTIONS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=16,
               num_gpu_blocks_override=80, max_num_snapshots=8)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}} for name in ("get_weather", "get_forecast")]
SPECS = {
    "json": dict(json=SCHEMA),
    "named call": dict(grammar=tool_call_grammar(TOOLS, "qwen3_coder", name="get_weather")),
    "required call": dict(grammar=tool_call_grammar(TOOLS, "qwen3_coder")),
    "regex": dict(regex=r"id-[0-9]{3}-(done|failed)"),
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def plain(checkpoint):
    return LLM(checkpoint, grammar_fast_forward=False, **OPTIONS)


@pytest.fixture(scope="module")
def fast(checkpoint):
    return LLM(checkpoint, **OPTIONS)          # grammar_fast_forward is on by default


def params(spec: str, **kwargs) -> SamplingParams:
    kwargs = dict(dict(temperature=0.0, max_tokens=120, logprobs=2), **kwargs)
    return SamplingParams(structured_outputs=StructuredOutputsParams(**SPECS[spec]), **kwargs)


def run(llm, prompts, params_list):
    """-> (outputs, engine steps it took)."""
    before = llm.engine.stats.num_steps
    outputs = [o.outputs[0] for o in llm.generate(prompts, params_list)]
    return outputs, llm.engine.stats.num_steps - before


def logprobs(output) -> list[float]:
    return [entry[t].logprob for entry, t in zip(output.logprobs, output.token_ids)]


@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_tokens_and_logprobs_equal_plain_in_fewer_steps(plain, fast, spec):
    want, plain_steps = run(plain, ["Call the tool:"], [params(spec)])
    got, fast_steps = run(fast, ["Call the tool:"], [params(spec)])
    assert got[0].token_ids == want[0].token_ids and got[0].text == want[0].text
    assert got[0].finish_reason == want[0].finish_reason == "stop"
    np.testing.assert_allclose(logprobs(got[0]), logprobs(want[0]), atol=2e-4)
    assert [sorted(e) for e in got[0].logprobs] == [sorted(e) for e in want[0].logprobs]    # top-2 ids too
    assert plain_steps == len(want[0].token_ids)          # one step a token without fast-forward
    assert fast_steps < plain_steps
    if spec.endswith("call"):                             # the forced prefix and tags: most of a call
        assert fast_steps <= len(want[0].token_ids) // 2, (fast_steps, len(want[0].token_ids))


def test_seeded_sampling_and_a_batch_with_free_rows_equal_plain(plain, fast):
    """A batch of a sampled named call, a sampled JSON row and an unconstrained sampled row: each row's tokens
    equal plain decoding's under the same seed (the verify window draws plain sampling's noise)."""
    prompts = ["Call the tool:", "Plan a trip:", "Say something:"]
    batch = [params("named call", temperature=1.0, seed=5), params("json", temperature=1.0, seed=6, max_tokens=40),
             SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)]
    want, _ = run(plain, prompts, batch)
    accepted = fast.engine.stats.num_accepted_draft_tokens
    got, _ = run(fast, prompts, batch)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(logprobs(g), logprobs(w), atol=2e-4)
    assert fast.engine.stats.num_accepted_draft_tokens > accepted


def test_forced_drafts_beside_suffix_drafting_equal_plain(plain, checkpoint):
    """With speculative_config suffix, a forced call drafts its forced tokens (verified with masks) and a free row
    beside it drafts from the text; tokens equal plain decoding's."""
    llm = LLM(checkpoint, speculative_config={"method": "suffix", "num_speculative_tokens": 3}, **OPTIONS)
    prompts = ["Call the tool:", "Say something:"]
    batch = [params("named call"), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    want, plain_steps = run(plain, prompts, batch)
    got, steps = run(llm, prompts, batch)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert steps < plain_steps
    assert llm.engine.stats.num_accepted_draft_tokens > 0


def test_window_masks_equal_plain_masks_token_by_token(checkpoint):
    """fill_window_bitmask's position j equals fill_bitmask after the first j drafts are consumed, for the forced
    tokens of a call, a draft the grammar rejects (later positions allow everything) and a row waiting for
    start_after; the states are left where they were."""
    from qnext.tokenizer import Tokenizer

    compiler = GrammarCompiler.for_tokenizer(Tokenizer.from_pretrained(checkpoint), 512, [2])
    vocab, eos = 512, [2]
    call = StructuredState(compiler.compile(StructuredOutputsParams(**SPECS["named call"])))
    forced = call.forced_after([])
    assert len(forced) > 8 and call.forced_after([]) == forced          # unchanged by asking
    regex = StructuredState(compiler.compile(StructuredOutputsParams(**SPECS["regex"])))
    bad = regex.forced_after([]) + [2, 3]
    waiting = StructuredState(compiler.compile(StructuredOutputsParams(**SPECS["regex"])), start_after=[7, 8])
    waiting_drafts = [5, 7, 8] + waiting.forced_after([7, 8])
    assert waiting.forced_after([7, 8]) == regex.forced_after([]) and waiting.forced_after([7]) == []
    width = 8
    masks = fill_window_bitmask([(0, call, forced[:width - 1]), (1, regex, bad), (2, waiting, waiting_drafts)],
                                3, width, vocab, eos)
    assert call.forced_after([]) == forced and not waiting.active          # states left as they were
    for row, (state, drafts) in enumerate([(call, forced[:width - 1]), (regex, bad), (waiting, waiting_drafts)]):
        state = state.copy()
        for j in range(width):
            used = j <= len(drafts) and state.needs_mask and not state.error     # else never kept: all allowed
            want = fill_bitmask([(0, state)], 1, vocab, eos)[0] if used else np.full_like(masks[row, j], -1)
            np.testing.assert_array_equal(masks[row, j], want, err_msg=f"row {row} position {j}")
            if j < len(drafts) and not state.error:
                state.advance(drafts[j])


def test_option_checked_and_off_where_windows_do_not_run():
    assert EngineConfig().max_draft_tokens == 7 and EngineConfig(block_size=4).max_draft_tokens == 3
    assert not EngineConfig(grammar_fast_forward=False).max_draft_tokens
    assert not EngineConfig(tensor_parallel_size=2).grammar_fast_forward_active
    assert not EngineConfig(enable_lora=True).grammar_fast_forward_active
    assert not EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2}
                            ).grammar_fast_forward_active
    with pytest.raises(ValueError, match="grammar_fast_forward must be True or False"):
        EngineConfig(grammar_fast_forward="yes")
