"""Structured outputs without a model: specs compile (cached) or fail with a message naming the problem, the
per-request state follows start_after, and the packed bitmask means the same tokens on the host and in the sampler."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qnext import SamplingParams, StructuredOutputsParams
from qnext.engine.sampler import apply_token_bitmask
from qnext.structured import GrammarCompiler, StructuredState, fill_bitmask, validate
from qnext.testing.tiny_tokenizer import build_tiny_tokenizer, tiny_eos_token_id

VOCAB = 520          # the model's vocabulary may be larger than the tokenizer's (512): the extra ids are never allowed


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(build_tiny_tokenizer(512), VOCAB, [tiny_eos_token_id()])


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(512)


def allowed(state: StructuredState) -> set[int]:
    bits = np.unpackbits(fill_bitmask([(0, state)], 1, VOCAB).view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def feed(state: StructuredState, tok, text: str) -> None:
    for t in tok.encode(text).ids:
        assert state.advance(t), (text, t)


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "frob"}}}), "json is invalid: Invalid type: frob"),
    (dict(json={"$ref": "#/definitions/missing"}), "json is invalid: Pointer"),
    (dict(json={"type": "string", "pattern": "(x"}), "json is invalid: regex parse error"),
    (dict(regex="(ab"), "(?s)regex is invalid: .*unclosed group"),
    (dict(grammar="start: foo"), '(?s)grammar is invalid: .*unknown name: "foo"'),
    (dict(grammar='root ::= "a" missing'), "grammar is invalid: .*'missing' not found"),
])
def test_invalid_specs_name_the_problem(compiler, spec, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=message):
        validate(params, compiler)


@pytest.mark.parametrize("spec, message", [
    (dict(), "exactly one of"), (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json="{not json"), "not valid JSON"), (dict(choice=[]), "non-empty list"),
    (dict(choice="ab"), "list of non-empty strings"), (dict(regex="a", start_after=[]), "start_after"),
    (dict(json_object=True, start_after=[-3]), "start_after"),
    (dict(choice=-1), "list of non-empty strings"), (dict(choice={"a": 1}), "list of non-empty strings"),
    (dict(regex="a", start_after=7), "start_after"),
])
def test_malformed_params_fail_at_construction(spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"regex": "a", "schema": {}})


def test_validate_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        validate(SamplingParams(structured_outputs={"regex": "a"}), None)
    validate(SamplingParams(), None)                 # unconstrained: nothing to check


def test_compiled_grammars_are_cached_per_spec(compiler, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    before = compiler.num_compiled
    first = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.num_compiled == before + 1
    reordered = {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    for spec in (StructuredOutputsParams(json=schema), StructuredOutputsParams(json=reordered)):
        compiler.compile(spec)
    assert compiler.num_compiled == before + 1, "the same schema compiled again"
    compiler.compile(StructuredOutputsParams(regex="[a-z]+"))
    assert compiler.num_compiled == before + 2
    # each request gets its own matcher: advancing one leaves the cached one (and the next copy) at the start
    state = StructuredState(first)
    feed(state, tok, '{"a":')
    assert allowed(StructuredState(compiler.compile(StructuredOutputsParams(json=schema)))) == {tok.token_to_id("{")}


def test_choice_allows_only_the_choices_then_completes(compiler, tok):
    state = StructuredState(compiler.compile(StructuredOutputsParams(choice=["yes", "no"])))
    first = allowed(state)
    assert first and all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in first)
    assert not first & set(range(512, VOCAB)), "ids past the tokenizer's vocabulary are allowed"
    feed(state, tok, "yes")
    assert state.is_complete and not state.needs_mask


def test_accepting_grammar_allows_eos_and_rejects_other_tokens(compiler, tok):
    eos = tiny_eos_token_id()
    state = StructuredState(compiler.compile(StructuredOutputsParams(regex="a+")))
    feed(state, tok, "a")
    assert eos in allowed(state) and not state.is_complete
    bad = tok.token_to_id("z")
    assert not state.advance(bad) and "not allowed" in state.error


def test_start_after_waits_for_the_exact_sequence(compiler, tok):
    trigger = tok.encode("</think>").ids + tok.encode("\n").ids
    state = StructuredState(compiler.compile(StructuredOutputsParams(regex="[0-9]+")), start_after=trigger)
    for t in tok.encode("some free text ").ids + trigger[:1] + tok.encode(" more").ids:
        assert state.advance(t) and not state.active and state.needs_mask     # eos only (below)
    for t in trigger:
        assert state.advance(t)
    assert state.active and allowed(state) <= {tok.token_to_id(str(d)) for d in range(10)} | {
        t for t in range(512) if tok.decode([t]).isdigit()}
    twin = state.copy()
    assert not state.advance(tok.token_to_id("a"))
    assert twin.advance(tok.token_to_id("7")) and twin.error is None, "a copy shares its matcher with the original"


def test_bitmask_bits_match_the_sampler_unpacking():
    rng = np.random.default_rng(0)
    for vocab in (VOCAB, 257):
        words = -(-vocab // 32)
        bitmask = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
        logits = rng.normal(size=(3, vocab)).astype(np.float32)
        masked = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
        np.testing.assert_array_equal(np.isfinite(masked), bits)
        np.testing.assert_array_equal(masked[bits], logits[bits])


def test_eos_ids_are_masked_until_the_grammar_accepts(compiler, tok):
    # a checkpoint may list an ordinary text token among its eos ids (the engine stops at it): a row may sample it
    # only where the output so far is a full match
    hash_id = tok.token_to_id("#")
    state = StructuredState(compiler.compile(StructuredOutputsParams(regex="[a#]{1,3}")))

    def allowed_with_eos(eos):
        bits = fill_bitmask([(1, state)], 2, VOCAB, eos)
        assert (bits[0] == -1).all(), "a row without a grammar lost tokens"
        return set(np.flatnonzero(np.unpackbits(bits[1].view(np.uint8), bitorder="little")[:VOCAB]).tolist())

    assert hash_id in allowed_with_eos([])
    assert hash_id not in allowed_with_eos([hash_id]) and tok.token_to_id("a") in allowed_with_eos([hash_id])
    feed(state, tok, "a")
    assert state.matcher.is_accepting() and hash_id in allowed_with_eos([hash_id])


def test_library_bench_runs_on_a_synthetic_vocabulary():
    """scripts/bench_structured.py's library part, small: the document is valid for its schema, llguidance masks it
    token by token on a synthetic byte-level vocabulary of the requested size."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    from qnext.bench.grammar_libraries import ORDER_DOCUMENT, ORDER_SCHEMA, compare
    from qnext.bench.synthetic_tokenizer import synthetic_tokenizer

    jsonschema.validate(json.loads(ORDER_DOCUMENT), ORDER_SCHEMA)
    tok = synthetic_tokenizer(3000)
    assert tok.get_vocab_size() == 3000 and tok.decode(tok.encode(ORDER_DOCUMENT).ids) == ORDER_DOCUMENT
    result = compare(tok, tok.token_to_id("<|endoftext|>"), libraries=("llguidance",), log=lambda msg: None)
    summary = result["llguidance"]
    assert summary["num_tokens"] > 20 and summary["mask_us_p50"] > 0 and summary["compile_ms"] > 0


def test_eos_is_masked_while_waiting_for_start_after(compiler, tok):
    # a forced call or schema after the reasoning: the request may not end before its grammar has started
    eos = tiny_eos_token_id()
    end = tok.token_to_id("</think>")
    state = StructuredState(compiler.compile(StructuredOutputsParams(regex="[0-9]{2}")), [end])
    assert state.needs_mask and not state.active
    bits = fill_bitmask([(0, state)], 1, VOCAB, [eos])
    allowed_ids = set(np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:VOCAB]).tolist())
    assert allowed_ids == set(range(VOCAB)) - {eos}
    assert state.advance(end) and state.active
