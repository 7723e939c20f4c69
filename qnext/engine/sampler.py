"""Sampling on device for a padded batch of rows, and the host code that builds its inputs.

Per row, as vLLM does it: min_tokens suppression -> repetition/frequency/presence penalties -> (temperature 0:
argmax here) -> temperature -> top-k -> top-p -> min-p -> Gumbel-max draw. Returned logprobs are those of the
RAW model logits (vLLM's default), whatever the row's processing.

Randomness: each row draws from fold_in(key(request), output_position), so a request's tokens depend only on its
seed (or, unseeded, on the engine seed and its arrival index) and never on the batch around it.

`sample` compiles once per (N, V, K, B) and per which optional stages the batch needs: top-k/top-p filtering
(a full sort) and penalties (two dense [N, V] arrays) are skipped, as None fields, when no row uses them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qnext.sampling_params import GREEDY_TEMPERATURE, SamplingParams

_KEY_IMPL = "threefry2x32"


class SamplingTensors(NamedTuple):
    temperature: jax.Array  # [N] f32; < GREEDY_TEMPERATURE = greedy
    min_p: jax.Array  # [N] f32; 0 = off
    key_data: jax.Array | None  # [N, 2] uint32, threefry key of the request; None: every row is greedy
    position: jax.Array  # [N] int32, output index of the token being drawn
    suppressed_ids: jax.Array  # [N, B] int32, ids masked to -inf (eos/stop ids before min_tokens); V pads
    top_k: jax.Array | None = None  # [N] int32 in [1, V] (V = off); None: no row filters
    top_p: jax.Array | None = None  # [N] f32 (1 = off)
    presence_penalty: jax.Array | None = None  # [N] f32; None (all five): no row uses penalties
    frequency_penalty: jax.Array | None = None  # [N] f32
    repetition_penalty: jax.Array | None = None  # [N] f32
    output_counts: jax.Array | None = None  # [N, V] int32, occurrences of each token in the output so far
    prompt_mask: jax.Array | None = None  # [N, V] bool, token occurs in the prompt


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # [N] int32
    logprobs: jax.Array  # [N] f32, raw log-softmax of the sampled token
    ranks: jax.Array  # [N] int32, 1 + number of tokens with a strictly higher raw logprob
    top_logprobs: jax.Array  # [N, K] f32, sorted descending
    top_ids: jax.Array  # [N, K] int32


def apply_penalties(logits, output_counts, prompt_mask, presence, frequency, repetition):
    """vLLM's penalties. Repetition divides positive / multiplies negative logits of every token seen in the
    prompt or the output; frequency and presence subtract per output occurrence / once per output token."""
    in_output = output_counts > 0  # [N, V]
    rep = jnp.where(in_output | prompt_mask, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def apply_top_k_top_p(logits, top_k, top_p):
    """Keeps the top_k largest logits, then the smallest prefix of those whose probability mass reaches top_p
    (at least one token). Tokens tied with the last kept logit are kept too."""
    v = logits.shape[-1]
    ranks = jnp.arange(v)[None, :]
    ordered = -jnp.sort(-logits, axis=-1)  # [N, V] descending
    in_top_k = ranks < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_kept = jnp.maximum(keep.sum(-1), 1)
    threshold = jnp.take_along_axis(ordered, (num_kept - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def apply_min_p(logits, min_p):
    """Drops tokens with probability < min_p * max probability, i.e. logit < max logit + log(min_p)."""
    threshold = logits.max(-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def first_argmax(x):
    """jnp.argmax over the last axis (first index of the maximum) as two plain reductions: XLA:CPU's fused
    (value, index) reduce is ~2x slower over a vocabulary row."""
    v = x.shape[-1]
    hit = x == x.max(axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.float32), jnp.inf), axis=-1), v - 1
                       ).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample(logits, tensors: SamplingTensors, num_logprobs: int | None = 0) -> SamplerOutput:
    """logits [N, V] -> one token per row. num_logprobs = K, the static top-logprobs width (logprobs_bucket);
    None when no row asked for logprobs: the log-softmax is skipped and `logprobs` is 0, `ranks` 1."""
    t = tensors
    logits = logits.astype(jnp.float32)
    n, v = logits.shape

    rows = jnp.arange(n)[:, None]
    x = logits.at[rows, t.suppressed_ids].set(-jnp.inf, mode="drop")
    if t.output_counts is not None:
        x = apply_penalties(x, t.output_counts, t.prompt_mask, t.presence_penalty, t.frequency_penalty,
                            t.repetition_penalty)
    greedy_tokens = first_argmax(x)

    is_greedy = t.temperature < GREEDY_TEMPERATURE
    x = x / jnp.where(is_greedy, 1.0, t.temperature)[:, None]
    if t.top_k is not None:
        x = apply_top_k_top_p(x, t.top_k, t.top_p)
    x = apply_min_p(x, t.min_p)

    if t.key_data is None:                       # an all-greedy batch draws no noise
        tokens = greedy_tokens.astype(jnp.int32)
    else:
        keys = jax.random.wrap_key_data(t.key_data, impl=_KEY_IMPL)
        keys = jax.vmap(jax.random.fold_in)(keys, t.position)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
        sampled = first_argmax(x + gumbel)
        tokens = jnp.where(is_greedy, greedy_tokens, sampled).astype(jnp.int32)
    no_top = (jnp.zeros((n, 0), jnp.float32), jnp.zeros((n, 0), jnp.int32))
    if num_logprobs is None:
        return SamplerOutput(tokens, jnp.zeros((n,), jnp.float32), jnp.ones((n,), jnp.int32), *no_top)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs == 0:                        # ranks and top-k only when someone asked for logprobs
        return SamplerOutput(tokens, token_logprobs, jnp.ones((n,), jnp.int32), *no_top)
    ranks = (raw_logprobs > token_logprobs[:, None]).sum(-1).astype(jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, num_logprobs)
    return SamplerOutput(tokens, token_logprobs, ranks, top_logprobs, top_ids.astype(jnp.int32))


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
        """True when every row's next tokens depend only on its logits and output position: no logprobs, no
        penalties (output counts) and no ids suppressed now (min_tokens, which is never active again once it is
        not). Such rows can draw several tokens in a row on device, each from these tensors at position + k."""
        return all(r.params.logprobs is None and not r.params.uses_penalties and not self._suppressed_ids(r)
                   for r in rows)

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
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            return []
        eos = () if p.ignore_eos else self.eos_token_ids
        return sorted({t for t in (*eos, *p.stop_token_ids) if 0 <= t < self.vocab_size})


def check_stop(params: SamplingParams, output_token_ids: Sequence[int], eos_token_ids: Sequence[int],
               num_tokens: int, max_model_len: int) -> tuple[str, int | None] | None:
    """vLLM's token-level stop check after a token was appended -> (finish_reason, stop_reason) or None.
    Before min_tokens only the length limits stop a request. Eos (any of eos_token_ids, unless ignore_eos) gives
    ("stop", None); a stop_token_id gives ("stop", id); max_tokens or max_model_len gives ("length", None).
    num_tokens = prompt + output. Stop strings are the detokenizer's (IncrementalDetokenizer.update)."""
    num_output = len(output_token_ids)
    if num_output >= params.min_tokens and num_output > 0:
        last = output_token_ids[-1]
        if not params.ignore_eos and last in eos_token_ids:
            return "stop", None
        if last in params.stop_token_ids:
            return "stop", last
    if num_tokens >= max_model_len or (params.max_tokens is not None and num_output >= params.max_tokens):
        return "length", None
    return None
