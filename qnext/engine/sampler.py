"""Sampling on device for a padded batch of rows (the host builds its inputs in sampling_inputs.py).

Per row, as vLLM does it: min_tokens suppression -> repetition/frequency/presence penalties -> (temperature 0:
argmax here) -> temperature -> top-k -> top-p -> min-p -> Gumbel-max draw. Returned logprobs are those of the
RAW model logits (vLLM's default), whatever the row's processing.

Randomness: each row draws from fold_in(key(request), output_position), so a request's tokens depend only on its
seed (or, unseeded, on the engine seed and its arrival index) and never on the batch around it.

`sample` compiles once per (N, V, K, B) and per which optional stages the batch needs: top-k/top-p filtering
(top_k_top_p.py: a window of each row's largest logits, no sort), penalties (two dense [N, V] arrays) and the
structured-output token bitmask are skipped, as None fields, when no row uses them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qnext.engine.top_k_top_p import apply_top_k_top_p
from qnext.model.argmax import first_argmax
from qnext.sampling_params import GREEDY_TEMPERATURE

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
    token_bitmask: jax.Array | None = None  # [N, ceil(V/32)] int32, bit t%32 of word t//32 set: token t allowed
                                            # (structured outputs); None: no row is constrained


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


def apply_min_p(logits, min_p):
    """Drops tokens with probability < min_p * max probability, i.e. logit < max logit + log(min_p)."""
    threshold = logits.max(-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def apply_token_bitmask(logits, bitmask):
    """Masks to -inf every token whose bit is clear in the row's packed bitmask [N, ceil(V/32)] int32."""
    ids = jnp.arange(logits.shape[-1])
    words = bitmask[:, ids >> 5]                                    # [N, V]
    allowed = ((words >> (ids & 31)) & 1).astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


def filter_logits(x, t: SamplingTensors):
    """Temperature, top-k / top-p, min-p: the logits a row draws from (-inf where filtered). Greedy rows (whose
    token is the argmax whatever this returns) are left unfiltered, so they never send the batch down top-k /
    top-p's slow path."""
    greedy = t.temperature < GREEDY_TEMPERATURE
    x = x / jnp.where(greedy, 1.0, t.temperature)[:, None]
    if t.top_k is not None:
        x = apply_top_k_top_p(x, jnp.where(greedy, x.shape[-1], t.top_k), jnp.where(greedy, 1.0, t.top_p))
    return apply_min_p(x, t.min_p)


def row_keys(t: SamplingTensors, offset=0):
    """Each row's key for the token at output position + offset (what `sample` draws that token with)."""
    keys = jax.random.wrap_key_data(t.key_data, impl=_KEY_IMPL)
    return jax.vmap(jax.random.fold_in)(keys, t.position + offset)


def gumbel_max(x, keys):
    """Each row's draw from softmax(x): first_argmax(x + Gumbel noise from the row's key) [N]. A loop over rows:
    a row's noise (1 MiB at 248k ids) stays in cache, where a batched draw writes and reads [N, V] of it (the same
    noise, 2-5x slower at 16 rows; scripts/bench_sampler.py)."""
    def one(row_and_key):
        row, key = row_and_key
        return first_argmax(row + jax.random.gumbel(key, row.shape, jnp.float32))
    return jax.lax.map(one, (x, keys))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample(logits, tensors: SamplingTensors, num_logprobs: int | None = 0) -> SamplerOutput:
    """logits [N, V] -> one token per row. num_logprobs = K, the static top-logprobs width (logprobs_bucket);
    None when no row asked for logprobs: the log-softmax is skipped and `logprobs` is 0, `ranks` 1."""
    t = tensors
    logits = logits.astype(jnp.float32)
    n = logits.shape[0]

    rows = jnp.arange(n)[:, None]
    x = logits.at[rows, t.suppressed_ids].set(-jnp.inf, mode="drop")
    if t.output_counts is not None:
        x = apply_penalties(x, t.output_counts, t.prompt_mask, t.presence_penalty, t.frequency_penalty,
                            t.repetition_penalty)
    if t.token_bitmask is not None:
        x = apply_token_bitmask(x, t.token_bitmask)
    greedy_tokens = first_argmax(x)

    is_greedy = t.temperature < GREEDY_TEMPERATURE
    x = filter_logits(x, t)

    if t.key_data is None:                       # an all-greedy batch draws no noise
        tokens = greedy_tokens.astype(jnp.int32)
    else:
        sampled = gumbel_max(x, row_keys(t))
        tokens = jnp.where(is_greedy, greedy_tokens, sampled).astype(jnp.int32)
    return token_logprobs(logits, tokens, num_logprobs)


def token_logprobs(logits, tokens, num_logprobs: int | None) -> SamplerOutput:
    """The logprobs `sample` reports for tokens [N] drawn from rows of raw logits [N, V]: the token's raw
    log-softmax, its rank and the top num_logprobs (None: none asked, logprob 0 and rank 1; 0: no rank or top)."""
    n = tokens.shape[0]
    no_top = (jnp.zeros((n, 0), jnp.float32), jnp.zeros((n, 0), jnp.int32))
    if num_logprobs is None:
        return SamplerOutput(tokens, jnp.zeros((n,), jnp.float32), jnp.ones((n,), jnp.int32), *no_top)
    raw_logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs == 0:                        # ranks and top-k only when someone asked for logprobs
        return SamplerOutput(tokens, chosen, jnp.ones((n,), jnp.int32), *no_top)
    ranks = (raw_logprobs > chosen[:, None]).sum(-1).astype(jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, num_logprobs)
    return SamplerOutput(tokens, chosen, ranks, top_logprobs, top_ids.astype(jnp.int32))
