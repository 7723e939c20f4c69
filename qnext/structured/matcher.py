"""A request's structured-output state: its llguidance matcher, advanced on every accepted token, and the
token bitmask of the next step for the rows that need one.

With `start_after` the output is free until it has emitted that exact id sequence (the end of the reasoning, say);
the matcher sees only the tokens after it. The state always matches the request's output tokens (it advances in
postprocess, once per appended token), so a preempted request that recomputes its output keeps it as it is.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

# The finish reason of a request whose grammar reached a dead end: the sampled token is not one the grammar allows
# (every token was masked, e.g. the only allowed one was suppressed by min_tokens, or the grammar cannot continue
# with this vocabulary). vLLM's name for a request that ended on an engine-side error; stop_reason says why.
DEAD_END = "error"


class StructuredState:
    def __init__(self, matcher: llguidance.LLMatcher, start_after: Sequence[int] | None = None,
                 grammar_eos_ids: frozenset[int] = frozenset()):
        """grammar_eos_ids: eos ids the grammar itself decides on (special tokens: the mask allows one only where
        the grammar is complete or names it); other eos ids are taken away until the output is a full match."""
        self.matcher = matcher
        self.grammar_eos_ids = grammar_eos_ids
        self.start_after = tuple(start_after or ())
        self.active = not self.start_after       # the grammar applies to the next token
        self._tail: list[int] = []               # last tokens, while waiting for start_after
        self.error: str | None = None

    def advance(self, token_id: int) -> bool:
        """Feeds one sampled output token. False: the grammar does not allow it, a dead end (`error` says why; the
        matcher stays in its error state and the request must end)."""
        if not self.active:
            self._tail = (self._tail + [token_id])[-len(self.start_after):]
            self.active = tuple(self._tail) == self.start_after
            return True
        if self.matcher.consume_token(token_id):
            return True
        self.error = f"structured output dead end: token {token_id} is not allowed by the grammar"
        return False

    def forced_after(self, tokens: Sequence[int]) -> list[int]:
        """The tokens the grammar forces once `tokens` are appended (llguidance's fast-forward tokens: the forced
        bytes in the tokenization the grammar's mask then allows, one token at each step), without changing the
        state. [] when it forces none, is not active by then, or rejects one of `tokens`."""
        if not self.active:                      # waiting for start_after: on a copy, which follows the trigger
            state = self.copy()
            if not all(state.advance(t) for t in tokens) or not state.active:
                return []
            return state.forced_after(())
        matcher, tokens = self.matcher, list(tokens)
        if matcher.is_error():
            return []
        consumed = matcher.try_consume_tokens(tokens) if tokens else 0
        try:
            return [] if consumed < len(tokens) or matcher.is_stopped() else list(matcher.compute_ff_tokens())
        finally:
            matcher.rollback(consumed)

    def copy(self) -> "StructuredState":
        """An independent state at the same point (a parallel sample's own matcher, n > 1)."""
        other = StructuredState(self.matcher.deep_copy(), self.start_after, self.grammar_eos_ids)
        other.active, other._tail, other.error = self.active, list(self._tail), self.error
        return other

    @property
    def needs_mask(self) -> bool:
        """Active and not done; or still waiting for start_after, when the mask only takes eos away (a request
        whose output must end in a match may not end before its grammar has started)."""
        return not self.active or not self.matcher.is_stopped()

    @property
    def is_complete(self) -> bool:
        """The grammar is active and can take no further token (eos included): the output is a full match."""
        return self.active and self.matcher.is_stopped() and not self.matcher.is_error()


_executor: llguidance.LLExecutor | None = None
# llguidance's thread pool pays off only with many rows and spare cores: on a 2-core host, where the XLA step runs
# on the same cores, 4 rows took ~55 us a row through the pool against ~14 us one after another.
PARALLEL_ROWS, PARALLEL_CPUS = 8, 8


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(rows: Sequence[tuple[int, StructuredState]], num_rows: int, vocab_size: int,
                 eos_token_ids: Sequence[int] = ()) -> np.ndarray:
    """[num_rows, ceil(V / 32)] int32 bitmask: bit t of row i (word t // 32, bit t % 32) set = token t allowed.
    Rows not listed allow everything (all ones); the listed rows' states must need a mask. Computed by
    llguidance's thread pool when several rows need one.

    The engine's eos ids are cleared in rows whose grammar does not accept the output so far: the engine stops a
    request at any of them, and a checkpoint may list an ordinary text token among them (llguidance would allow
    it as text), so a constrained row samples one only where stopping leaves a full match. Eos ids in a row's
    grammar_eos_ids (special tokens) are left as llguidance decided: it allows them only where the grammar names
    them, e.g. `... <|im_end|>`."""
    global _executor
    bitmask = np.full((num_rows, bitmask_words(vocab_size)), -1, np.int32)
    waiting = [(i, s) for i, s in rows if not s.active]      # before start_after: all tokens but eos
    rows = [(i, s) for i, s in rows if s.active]
    if len(rows) >= PARALLEL_ROWS and (os.cpu_count() or 1) >= PARALLEL_CPUS:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(_executor, [(s.matcher, i) for i, s in rows], bitmask)
    else:
        for i, state in rows:
            llguidance.numpy.fill_next_token_bitmask(state.matcher, bitmask, i)
    for i, state in rows + waiting:
        _clear_eos(bitmask[i], state, eos_token_ids, vocab_size)
    return bitmask


def _clear_eos(words: np.ndarray, state: StructuredState, eos_token_ids: Sequence[int], vocab_size: int) -> None:
    """Clears the engine's eos ids in one row's mask [ceil(V / 32)] unless the state accepts the output so far
    (fill_bitmask's rule)."""
    if state.active and state.matcher.is_accepting():
        return
    eos = np.asarray([t for t in eos_token_ids if 0 <= t < vocab_size
                      and not (state.active and t in state.grammar_eos_ids)], np.int64)
    if eos.size:
        clear = ~(np.int64(1) << (eos & 31)).astype(np.uint32).view(np.int32)
        np.bitwise_and.at(words, eos >> 5, clear)


def fill_window_bitmask(rows: Sequence[tuple[int, StructuredState, Sequence[int]]], num_rows: int, width: int,
                        vocab_size: int, eos_token_ids: Sequence[int] = ()) -> np.ndarray:
    """[num_rows, width, ceil(V / 32)] int32: the mask of every position of a verify window. Row i's position j is
    masked by its grammar's state after its drafts d_1..d_j (fill_bitmask's rules, eos included), which is what
    plain decoding would mask the token there with if those drafts are kept, the only case in which it is used.
    rows: (row, state, drafts); a row's positions past its drafts, past a draft its grammar rejects, and rows not
    listed allow everything. The states are left as they were (advanced and rolled back, or copied)."""
    bitmask = np.full((num_rows, width, bitmask_words(vocab_size)), -1, np.int32)
    flat = bitmask.reshape(num_rows * width, -1)
    for i, state, drafts in rows:
        drafts = list(drafts)[:width - 1]
        if not state.active:                     # waiting for start_after: a copy follows the trigger
            state = state.copy()
            for j in range(len(drafts) + 1):
                _fill_position(flat, i * width + j, state, eos_token_ids, vocab_size)
                if j == len(drafts) or not state.advance(drafts[j]) or not state.needs_mask:
                    break
            continue
        matcher, consumed = state.matcher, 0
        try:
            for j in range(len(drafts) + 1):
                _fill_position(flat, i * width + j, state, eos_token_ids, vocab_size)
                if j == len(drafts) or matcher.try_consume_tokens([drafts[j]]) != 1:
                    break
                consumed += 1
                if matcher.is_stopped():         # complete: the request ends at that draft
                    break
        finally:
            matcher.rollback(consumed)
    return bitmask


def _fill_position(flat: np.ndarray, index: int, state: StructuredState, eos_token_ids: Sequence[int],
                   vocab_size: int) -> None:
    if state.active:
        llguidance.numpy.fill_next_token_bitmask(state.matcher, flat, index)
    _clear_eos(flat[index], state, eos_token_ids, vocab_size)
