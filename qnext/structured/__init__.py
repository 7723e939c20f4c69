"""Structured outputs: a request's StructuredOutputsParams compiled by llguidance into a matcher that gives the
token mask of each step (docs/structured.md)."""
from qnext.structured.compiler import GrammarCompiler, grammar_spec, validate
from qnext.structured.matcher import DEAD_END, StructuredState, fill_bitmask

__all__ = ["DEAD_END", "GrammarCompiler", "StructuredState", "fill_bitmask", "grammar_spec", "validate"]
