"""Host side of sampling: per-request keys, penalty counts and min_tokens suppression, laid out as the
SamplingTensors of a padded batch for the device sampler (sampler.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qnext.engine.sampler import SamplingTensors
from qnext.sampling_params import SamplingParams


def logprobs_bucket(max_logprobs: int) -> int:
    """Static top-logprobs width K for a batch whose largest request asks for max_logprobs: 0 or a power of 2."""
    return 0 if max_logprobs <= 0 else 1 << (max_logprobs - 1).bit_length()


def request_key_data(seed: int | None, engine_seed: int, request_index: int) -> np.ndarray:
    """[2] uint32 threefry key: from the request's own seed, else from (engine seed, arrival index)."""
    if seed is not None:
        seed %= 1 << 64
        return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    return np.random.SeedSequence([engine_seed % (1 << 64), request_index]).generate_state(2, np.uint32)


class PenaltyState:
    """Per request: counts of each output token [V] int32 and the prompt-token mask [V] bool, kept on host and
    updated incrementally (only tokens appended since the last call are counted)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._rows: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}

    def get(self, request_id: str, prompt_token_ids: Sequence[int],
            output_token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        row = self._rows.get(request_id)
        if row is None or row[2] > len(output_token_ids):
            prompt_mask = np.zeros(self.vocab_size, np.bool_)
            prompt_mask[np.asarray(prompt_token_ids, np.int64)] = True
            row = (np.zeros(self.vocab_size, np.int32), prompt_mask, 0)
        counts, prompt_mask, num_counted = row
        np.add.at(counts, np.asarray(output_token_ids[num_counted:], np.int64), 1)
        self._rows[request_id] = (counts, prompt_mask, len(output_token_ids))
        return counts, prompt_mask

    def free(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)


@dataclass
class SamplingRow:
    """Host view of one request that samples a token this step."""
    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; its length is the position of the token drawn now
    request_index: int = 0  # engine-wide arrival counter; seeds unseeded requests


class SamplerInputBuilder:
    """Builds SamplingTensors for a padded batch. Padding rows are greedy with no suppression.
    Call free(request_id) when a request finishes."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = (), seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self.penalties = PenaltyState(vocab_size)
        self._key_data: dict[str, np.ndarray] = {}

    def build(self, rows: Sequence[SamplingRow], num_rows: int) -> tuple[SamplingTensors, int]:
        """-> (tensors with leading dim num_rows, num_logprobs K for `sample`: None when no row wants logprobs)."""
        if len(rows) > num_rows:
            raise ValueError(f"{len(rows)} rows do not fit a batch of {num_rows}")
        n, v = num_rows, self.vocab_size
        temperature = np.zeros(n, np.float32)
        min_p = np.zeros(n, np.float32)
        key_data = np.zeros((n, 2), np.uint32)
        position = np.zeros(n, np.int32)
        suppressed = [self._suppressed_ids(r) for r in rows]
        width = max(4, logprobs_bucket(max((len(s) for s in suppressed), default=0)))
        suppressed_ids = np.full((n, width), v, np.int32)
        for i, (r, ids) in enumerate(zip(rows, suppressed)):
            p = r.params
            temperature[i] = 0.0 if p.greedy else p.temperature
            min_p[i] = p.min_p
            key_data[i] = self._request_key_data(r)
            position[i] = len(r.output_token_ids)
            suppressed_ids[i, :len(ids)] = ids
        all_greedy = all(r.params.greedy for r in rows)
        tensors = SamplingTensors(temperature, min_p, None if all_greedy else key_data, position, suppressed_ids)

        if any(r.params.uses_top_k_top_p for r in rows):
            top_k = np.full(n, v, np.int32)
            top_p = np.ones(n, np.float32)
            for i, r in enumerate(rows):
                if r.params.top_k > 0:
                    top_k[i] = min(r.params.top_k, v)
                top_p[i] = r.params.top_p
            tensors = tensors._replace(top_k=top_k, top_p=top_p)

        if any(r.params.uses_penalties for r in rows):
            presence = np.zeros(n, np.float32)
            frequency = np.zeros(n, np.float32)
            repetition = np.ones(n, np.float32)
            counts = np.zeros((n, v), np.int32)
            prompt_mask = np.zeros((n, v), np.bool_)
            for i, r in enumerate(rows):
                p = r.params
                if not p.uses_penalties:
                    continue
                presence[i], frequency[i], repetition[i] = (p.presence_penalty, p.frequency_penalty,
                                                            p.repetition_penalty)
                counts[i], prompt_mask[i] = self.penalties.get(r.request_id, r.prompt_token_ids,
                                                               r.output_token_ids)
            tensors = tensors._replace(presence_penalty=presence, frequency_penalty=frequency,
                                       repetition_penalty=repetition, output_counts=counts,
                                       prompt_mask=prompt_mask)

        if all(r.params.logprobs is None for r in rows):
            return tensors, None
        num_logprobs = logprobs_bucket(max((r.params.logprobs or 0 for r in rows), default=0))
        return tensors, min(num_logprobs, v)

    def plain_greedy(self, rows: Sequence[SamplingRow]) -> bool:
        """True when every row's token is the argmax of its raw logits: greedy, no logprobs, no penalties and no
        ids suppressed now (min_tokens). `sample` would return exactly that token, logprob 0 and rank 1."""
        return all(r.params.greedy for r in rows) and self.stateless(rows)

    def stateless(self, rows: Sequence[SamplingRow]) -> bool:
        return all(stateless(r.params, len(r.output_token_ids), self.eos_token_ids, self.vocab_size) for r in rows)

    def free(self, request_id: str) -> None:
        self.penalties.free(request_id)
        self._key_data.pop(request_id, None)

    def _request_key_data(self, row: SamplingRow) -> np.ndarray:
        key = self._key_data.get(row.request_id)
        if key is None:
            key = request_key_data(row.params.seed, self.seed, row.request_index)
            self._key_data[row.request_id] = key
        return key

    def _suppressed_ids(self, row: SamplingRow) -> list[int]:
        return suppressed_ids(row.params, len(row.output_token_ids), self.eos_token_ids, self.vocab_size)


def suppressed_ids(params: SamplingParams, num_output: int, eos_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """Ids masked for the token drawn at output position num_output: eos (unless ignored) and stop token ids
    while the request is short of min_tokens."""
    if num_output >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else eos_token_ids
    return sorted({t for t in (*eos, *params.stop_token_ids) if 0 <= t < vocab_size})


def stateless(params: SamplingParams, num_output: int, eos_token_ids: Sequence[int], vocab_size: int, *,
              penalties_ok: bool = False, logprobs_ok: bool = False, grammar_ok: bool = False) -> bool:
    """True when a request's next tokens depend only on its logits and output position: no logprobs, no
    penalties (output counts), no ids suppressed now (min_tokens, which is never active again once it is not) and
    no structured output (a grammar masks each token by the ones before it, on the host) and no thinking budget
    (it forces `</think>` at a step the host decides).
    Such rows can draw several tokens in a row on device, each from the same tensors at position + k.
    penalties_ok: penalties allowed (a speculative step applies them per window position, from the output counts
    and the drafts before each position: spec_decode.penalized); logprobs_ok: logprobs allowed (a speculative step
    reports them for every window position); grammar_ok: structured outputs allowed (a host-draft verify window
    masks each position by the grammar's state after the drafts before it: matcher.fill_window_bitmask)."""
    return ((logprobs_ok or params.logprobs is None) and (penalties_ok or not params.uses_penalties)
            and (grammar_ok or params.structured_outputs is None)
            and params.thinking_token_budget is None
            and not suppressed_ids(params, num_output, eos_token_ids, vocab_size))
