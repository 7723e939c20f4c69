"""The forced-tool-call grammar, run by llguidance on the tiny tokenizer with random token choices: every output
is a well-formed call of a declared tool that the parser reads back with schema-valid arguments."""
from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import pytest

from qnext.agents import OutputParser
from qnext.agents.tool_grammar import ToolGrammarError, tool_call_grammar
from qnext.testing.tiny_tokenizer import build_tiny_tokenizer

VOCAB = 512
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["C", "F"]},
    "ratio": {"type": "number"},
    "opts": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
             "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tiny_tokenizer(VOCAB)
    return tok, llguidance.LLTokenizer(tok.to_str(), eos_token=tok.token_to_id("<|im_end|>"))


def random_output(tokenizer, grammar: str, seed: int, max_tokens: int = 600) -> str:
    tok, ll_tok = tokenizer
    matcher = llguidance.LLMatcher(ll_tok, llguidance.grammar_from("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    rng = np.random.default_rng(seed)
    mask = llg_numpy.allocate_token_bitmask(1, ll_tok.vocab_size)
    out = []
    while not matcher.is_stopped() and len(out) < max_tokens:
        llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
        logits = np.where(allowed, 3 * rng.standard_normal(VOCAB), -np.inf)
        p = np.exp(logits - logits.max())
        token = int(rng.choice(VOCAB, p=p / p.sum()))
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    assert matcher.is_stopped(), "the grammar did not complete"
    return tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("fmt", ["qwen3_coder", "hermes"])
@pytest.mark.parametrize("name,parallel", [(None, True), ("get_weather", False)])
def test_random_choices_give_valid_calls(tokenizer, fmt, name, parallel):
    grammar = tool_call_grammar(TOOLS, fmt, name=name, parallel=parallel)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    seen = set()
    for seed in range(8):
        text = random_output(tokenizer, grammar, seed)
        parsed = OutputParser(tool_parser=fmt, tools=TOOLS).parse_whole(text)
        assert parsed.content == "" and parsed.tool_calls, text
        assert parallel or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            assert name is None or call.name == name
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            seen.add(call.name)
    assert name is None or seen == {name}


def test_bad_tools_are_named():
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "bogus"}}}}}]
    with pytest.raises(ToolGrammarError, match="tool 'f'"):
        tool_call_grammar(bad, "hermes")
    weird_key = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a b>": {"type": "string"}}}}}]
    with pytest.raises(ToolGrammarError, match="parameter name"):
        tool_call_grammar(weird_key, "qwen3_coder")
    with pytest.raises(ToolGrammarError, match="no tool named 'g'"):
        tool_call_grammar(TOOLS, "qwen3_coder", name="g")
