"""StructuredOutputsParams -> llguidance grammar -> a compiled matcher, cached per spec.

llguidance compiles a grammar against the tokenizer when an LLMatcher is built (lexer, token trie slices); a
request's matcher is a deep copy of the cached, never-advanced one for its spec, so each distinct spec compiles
once per engine. The llguidance tokenizer is built from the checkpoint's tokenizer on first use (llg_tokenizer.py: added
tokens that are not special, like Qwen's `<tool_call>`, are text); its vocabulary is the model's (ids past the
tokenizer's, padding rows of the embedding, are never allowed).
"""
from __future__ import annotations

import collections
import json
import threading

import llguidance
import tokenizers

from qnext.sampling_params import SamplingParams, StructuredOutputsParams
from qnext.structured.llg_tokenizer import llguidance_tokenizer

# JSON whitespace between tokens: at most this many characters at each place JSON allows it. llguidance's default
# (any amount) lets a model loop on whitespace forever, a known failure of unbounded JSON grammars; 16 still
# allows pretty-printing a few levels deep.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
_LIMITS = dict(verbose_errors=False)     # errors name the problem without dumping the parser state


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a spec. Does not check it: GrammarCompiler.compile does."""
    kind = params.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    return llguidance.grammar_from("grammar", params.grammar)   # Lark in llguidance's dialect; GBNF is converted


def _cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json" and isinstance(value, dict):
        value = json.dumps(value, sort_keys=True)
    elif kind == "choice":
        value = json.dumps(value)
    return kind, str(value)


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; thread-safe (front ends may validate on their own
    threads). `num_compiled` counts compilations (cache misses)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: list[int],
                 max_cached: int = 256):
        """tokenizer: the HuggingFace `tokenizers` backend."""
        if not eos_token_ids:
            raise ValueError("structured outputs need an eos token id (the grammar allows it once complete)")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance_tokenizer(tokenizer, vocab_size, list(eos_token_ids))
        # eos ids that are special tokens: a grammar allows one only where it is complete or where it names the
        # token itself (`<|im_end|>` in Lark), never as text
        self.special_eos_token_ids = frozenset(t for t in eos_token_ids if self.tokenizer.is_special_token(t))
        self._limits = llguidance.LLParserLimits(**_LIMITS)
        self._cache: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = collections.OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self.num_compiled = 0

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids) -> "GrammarCompiler":
        """From a qnext Tokenizer (its HuggingFace `tokenizers` backend)."""
        return cls(tokenizer.backend, vocab_size, list(eos_token_ids))

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for the spec (a copy of the cached compiled one). ValueError naming the problem when the
        schema, regex or grammar is invalid."""
        key = _cache_key(params)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        template = self._build(params)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = template
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        kind = params.kind
        try:
            grammar = grammar_spec(params)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} is invalid: {_first_lines(matcher.get_error())}")
        return matcher


def validate(params: SamplingParams, compiler: GrammarCompiler | None) -> llguidance.LLMatcher | None:
    """Checks a request's structured_outputs before admission and returns its fresh matcher (None when it has
    none); the compiled grammar stays cached. ValueError when the spec is invalid or there is no tokenizer to
    compile it for."""
    if params.structured_outputs is None:
        return None
    if compiler is None:
        raise ValueError("structured_outputs need the checkpoint's tokenizer (tokenizer.json), which this engine "
                         "does not have")
    return compiler.compile(params.structured_outputs)


def _first_lines(message: str, limit: int = 600) -> str:
    message = message.split("\n<state>")[0].strip()
    return message if len(message) <= limit else message[:limit] + "..."
