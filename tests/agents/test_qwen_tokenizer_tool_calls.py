"""Forced tool calls in both of Qwen's formats on Qwen3.5's real vocabulary, without a model: random walks through
the forced-call grammar (each step a random token the mask allows, as random weights at temperature 1 would pick),
streamed token by token through the detokenizer and the output parser, must give calls that parse and validate."""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from qnext.agents.events import assemble
from qnext.agents.output_parser import OutputParser
from qnext.agents.tool_grammar import tool_call_grammar
from qnext.sampling_params import SamplingParams, StructuredOutputsParams
from qnext.structured import GrammarCompiler
from qnext.structured.matcher import StructuredState, fill_bitmask
from qnext.testing.qwen_tokenizer import QWEN35_EOS_TOKEN_IDS, QWEN35_VOCAB_SIZE, write_qwen35_tokenizer
from qnext.testing.tiny_tokenizer import TINY_CHAT_TEMPLATE
from qnext.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.support.agent_server_cases import SCHEMAS, TOOLS

TOOL_CALL, TOOL_CALL_END = 248058, 248059


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("qwen35_tokenizer")
    write_qwen35_tokenizer(path, TINY_CHAT_TEMPLATE)
    return Tokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tok, QWEN35_VOCAB_SIZE, QWEN35_EOS_TOKEN_IDS)


def random_walk(state: StructuredState, rng: random.Random, max_steps: int = 400) -> list[int]:
    """Tokens a sampler would emit under the grammar's masks, each picked at random among the allowed ones, until
    the grammar is complete and an eos is sampled."""
    tokens = []
    for _ in range(max_steps):
        mask = fill_bitmask([(0, state)], 1, QWEN35_VOCAB_SIZE, QWEN35_EOS_TOKEN_IDS)
        allowed = np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]
        assert allowed.size, state.matcher.get_error()
        token = int(allowed[rng.randrange(allowed.size)])
        if token in QWEN35_EOS_TOKEN_IDS:
            assert state.matcher.is_accepting()
            return tokens
        assert state.advance(token), state.error
        tokens.append(token)
    raise AssertionError(f"no end after {max_steps} tokens")


def streamed_parse(tok: Tokenizer, tokens: list[int], fmt: str):
    """The output parser fed one detokenized token at a time (tags arrive as one piece each), and fed the whole."""
    detok = IncrementalDetokenizer(tok, SamplingParams())
    parser = OutputParser(tool_parser=fmt, tools=TOOLS)
    events = []
    for t in tokens:
        detok.update([t])
        events += parser.feed(detok.get_next_output_text(finished=False, delta=True))
    detok.update([], finished=True)
    events += parser.feed(detok.get_next_output_text(finished=True, delta=True)) + parser.finish()
    whole = OutputParser(tool_parser=fmt, tools=TOOLS).parse_whole(tok.decode(tokens))
    return assemble(events, False), whole


def _calls(parsed) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.tool_calls]   # ids are random


@pytest.mark.parametrize("fmt", ["qwen3_coder", "hermes"])
@pytest.mark.parametrize("forced", ["required", "search"])
def test_random_forced_calls_parse_and_validate(tok, compiler, fmt, forced):
    name = None if forced == "required" else forced
    grammar = tool_call_grammar(TOOLS, fmt, name=name, parallel=forced == "required")
    rng = random.Random(hash((fmt, forced)) & 0xFFFF)
    for _ in range(8):
        state = StructuredState(compiler.compile(StructuredOutputsParams(grammar=grammar)))
        tokens = random_walk(state, rng)
        assert tokens[0] == TOOL_CALL and tokens.count(TOOL_CALL) == tokens.count(TOOL_CALL_END) >= 1
        streamed, whole = streamed_parse(tok, tokens, fmt)
        assert (streamed.content, _calls(streamed)) == (whole.content, _calls(whole))
        assert whole.content == "" and whole.tool_calls, tok.decode(tokens)
        for call in whole.tool_calls:
            assert name is None or call.name == name
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_auto_mode_parses_single_token_tags_after_text_and_reasoning(tok):
    """A model's own output (auto mode): reasoning, text, then a call, every tag one token."""
    output = ("I should look it up.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=search>\n"
              "<parameter=query>\nParis\n</parameter>\n<parameter=limit>\n3\n</parameter>\n</function>\n"
              "</tool_call>")
    tokens = tok.encode(output)
    assert {248069, TOOL_CALL, TOOL_CALL_END} <= set(tokens)
    detok = IncrementalDetokenizer(tok, SamplingParams())
    parser = OutputParser(reasoning=True, tool_parser="qwen3_coder", tools=TOOLS)
    events = []
    for t in tokens:
        detok.update([t])
        events += parser.feed(detok.get_next_output_text(finished=False, delta=True))
    events += parser.finish()
    parsed = assemble(events, True)
    assert parsed.reasoning == "I should look it up.\n" and parsed.content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("search", {"query": "Paris",
                                                                                           "limit": 3})]
