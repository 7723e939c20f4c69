"""Grammar libraries side by side on one JSON schema and one tokenizer: compile time and token-mask time per
token along a valid document (scripts/bench_structured.py). llguidance is the engine's; xgrammar and outlines-core
are measured when importable (neither is a qnext dependency)."""
from __future__ import annotations

import json
import statistics
import time

import numpy as np

from qnext.optional import optional_import

# A realistic response_format schema: nested objects, an array of objects, enums, a pattern, numbers, a nullable.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{6}"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
            "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}, "price": {"type": "number"},
            "tags": {"type": "array", "items": {"enum": ["new", "sale", "gift", "fragile"]}}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"]},
        "priority": {"type": "boolean"},
    },
    "required": ["id", "customer", "items", "status", "notes", "priority"],
    "additionalProperties": False,
}
ORDER_DOCUMENT = json.dumps({
    "id": "ABC-123456",
    "customer": {"name": "Anna Lindqvist", "email": "anna@example.com", "age": 34},
    "items": [{"sku": "LAMP-01", "quantity": 2, "price": 19.5, "tags": ["new", "gift"]},
              {"sku": "BULB-60W", "quantity": 12, "price": 1.25, "tags": []}],
    "status": "paid", "notes": "leave at the door, ring twice", "priority": False,
}, separators=(",", ":"))


def token_bytes(tok) -> list[bytes]:
    """Each id's bytes for a byte-level `tokenizers.Tokenizer` (special tokens: their text)."""
    from qnext.bench.synthetic_tokenizer import _byte_to_unicode

    decode = {c: b for b, c in _byte_to_unicode().items()}
    special = {i for i, t in tok.get_added_tokens_decoder().items()}
    out = []
    for i in range(tok.get_vocab_size()):
        piece = tok.id_to_token(i)
        out.append(piece.encode() if i in special else bytes(decode[c] for c in piece))
    return out


def _summary(compile_s: list[float], mask_s: list[float], setup_s: float) -> dict:
    return {"tokenizer_setup_ms": 1e3 * setup_s, "compile_ms": 1e3 * min(compile_s),
            "compile_plus_document_ms": 1e3 * (min(compile_s) + sum(mask_s)),   # lazy compilers pay in masks
            "mask_us_mean": 1e6 * statistics.fmean(mask_s), "mask_us_p50": 1e6 * statistics.median(mask_s),
            "mask_us_max": 1e6 * max(mask_s), "num_tokens": len(mask_s)}


def bench_llguidance(tok_json: str, vocab: int, eos: int, schema: dict, repeats: int = 3):
    import llguidance
    import llguidance.numpy

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=[eos])
    setup = time.perf_counter() - t0
    doc = lt.greedy_tokenize(ORDER_DOCUMENT)
    compile_s, mask_s = [], []
    for r in range(repeats):           # a fresh matcher each time: what a new schema costs (no cache)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            dict(schema, title=f"t{r}"), defaults={"whitespace_flexible": False})
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    for t in doc:
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(m, bitmask)
        mask_s.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return _summary(compile_s, mask_s, setup), doc


def bench_xgrammar(pieces: list[bytes], vocab: int, eos: int, schema: dict, doc: list[int], repeats: int = 3):
    xgr = optional_import("xgrammar", "grammar-bench", "the xgrammar row of the grammar benchmark")

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(pieces, vocab_type=xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    compile_s, mask_s = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(dict(schema, title=f"t{r}")), any_whitespace=False,
                                                separators=(",", ":"))
        compile_s.append(time.perf_counter() - t0)
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for t in doc:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        mask_s.append(time.perf_counter() - t0)
        assert m.accept_token(t), t
    return _summary(compile_s, mask_s, setup)


def bench_outlines_core(pieces: list[bytes], vocab: int, eos: int, schema: dict, doc: list[int], repeats: int = 1):
    outlines_core = optional_import("outlines_core", "grammar-bench", "the outlines-core row of the grammar benchmark")
    Guide, Index, Vocabulary = outlines_core.Guide, outlines_core.Index, outlines_core.Vocabulary
    build_regex_from_schema = optional_import("outlines_core.json_schema", "grammar-bench",
                                              "the outlines-core row of the grammar benchmark").build_regex_from_schema

    t0 = time.perf_counter()
    mapping: dict[bytes, list[int]] = {}
    for i, p in enumerate(pieces):
        if i != eos:
            mapping.setdefault(p, []).append(i)
    vocabulary = Vocabulary(eos, mapping)
    setup = time.perf_counter() - t0
    compile_s, mask_s = [], []
    for _ in range(repeats):           # the regex index is built over the whole vocabulary: slow, so once
        t0 = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), vocabulary)
        compile_s.append(time.perf_counter() - t0)
    guide = Guide(index)
    words = -(-vocab // 32)
    mask = np.zeros(words, np.int32)
    for t in doc:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        mask_s.append(time.perf_counter() - t0)
        guide.advance(t)
    return _summary(compile_s, mask_s, setup)


def compare(tok, eos: int, schema: dict = ORDER_SCHEMA, libraries=("llguidance", "xgrammar", "outlines-core"),
            log=print) -> dict:
    """{library: summary or {'error': ...}} for one tokens.Tokenizer; the same token ids are fed to each."""
    vocab = tok.get_vocab_size()
    out = {}
    out["llguidance"], doc = bench_llguidance(tok.to_str(), vocab, eos, schema)
    log(f"  llguidance    vocab {vocab}: {out['llguidance']}")
    pieces = token_bytes(tok) if len(libraries) > 1 else None
    for name, fn in (("xgrammar", bench_xgrammar), ("outlines-core", bench_outlines_core)):
        if name not in libraries:
            continue
        try:
            out[name] = fn(pieces, vocab, eos, schema, doc)
        except Exception as e:         # not installed or failed: reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        log(f"  {name:13} vocab {vocab}: {out[name]}")
    return out
