"""The verify step of drafts chosen on the host (suffix and n-gram drafting, grammar-forced tokens: docs/speculative.md):
one target pass over each row's window [x_{N-1}, d_1 .. d_n] (n from 0 to the window's width - 1, its own per row),
the tokens plain decoding would emit at every window position, the longest prefix of drafts equal to them, and
exact state rollback (qnext/model/verify.py: the state after the last kept position goes to the row's own state
row; nothing else is written). No draft head runs.

Acceptance reproduces plain decoding token for token, sampled rows too: at window position j the target's token is
drawn as `sampler.sample` draws the token at output position + j (penalties with d_1..d_j counted, temperature,
top-k / top-p / min-p, the Gumbel noise of the row's key at that position), and d_j is kept when it equals that
token. With a draft that is a fixed token (a one-hot distribution) this is rejection sampling whose acceptance
probability is p(d) as in Leviathan et al., coupled through the shared noise: a kept token is the one plain
sampling draws under the same seed, and the first other token is plain sampling's too, so the output is plain
decoding's whatever the drafts (a seeded request's tokens equal plain decoding's, not only its distribution).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qnext.config import ModelConfig
from qnext.engine.sampler import SamplingTensors, filter_logits, gumbel_max, row_keys, token_logprobs
from qnext.engine.spec_decode import penalized
from qnext.engine.window import WindowInputs
from qnext.model.argmax import first_argmax
from qnext.model.forward import decoder_stack, lm_logits
from qnext.model.norms import rms_norm
from qnext.model.step_inputs import StepInputs
from qnext.model.verify import commit_positions, verify_deltanet
from qnext.sampling_params import GREEDY_TEMPERATURE


def plain_tokens(logits, drafts, tensors: SamplingTensors | None):
    """logits [N, W, V] raw; drafts [N, W - 1]. The token plain decoding emits at each window position when the
    drafts before it were kept: greedy rows the argmax of the (penalized) logits, sampled rows `sample`'s draw with
    the row's key at output position + j. [N, W] int32."""
    n, width, v = logits.shape
    logits = logits.astype(jnp.float32)
    if tensors is not None and tensors.output_counts is not None:
        logits = penalized(logits, drafts, tensors)
    greedy = first_argmax(logits).astype(jnp.int32)
    if tensors is None or tensors.key_data is None:
        return greedy
    per_position = tensors._replace(**{
        f: jnp.repeat(getattr(tensors, f), width, axis=0)
        for f in ("temperature", "min_p", "key_data", "position", "top_k", "top_p") if getattr(tensors, f) is not None})
    per_position = per_position._replace(position=per_position.position + jnp.tile(jnp.arange(width), n))
    drawn = gumbel_max(filter_logits(logits.reshape(n * width, v), per_position), row_keys(per_position))
    is_greedy = (tensors.temperature < GREEDY_TEMPERATURE)[:, None]
    return jnp.where(is_greedy, greedy, drawn.reshape(n, width).astype(jnp.int32))


@functools.lru_cache(maxsize=None)
def make_draft_verify_step(cfg: ModelConfig):
    """jit(params, buffers, inputs, window, sampling, num_logprobs=None) -> (tokens [D, W] int32, ran [D] int32,
    buffers, logprobs): inputs the verify layout (spec_step.verify_inputs) of W positions a row, window's drafts
    [D, W - 1] (a row's drafts past its own count are never kept: window.steps bounds what it keeps), sampling /
    num_logprobs as make_spec_step's. Row i keeps tokens[i, :ran[i]]: its drafts equal to plain decoding's tokens and
    one more, cut at a stop token id and its budget. Cache buffers are donated."""

    def run(params, buffers, inputs: StepInputs, window: WindowInputs, sampling: SamplingTensors | None,
            num_logprobs: int | None = None):
        pre = inputs.prefill
        d, width = pre.token_index.shape
        x, pending = decoder_stack(params, buffers, inputs, cfg, linear_layer=verify_deltanet)
        hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        logits = lm_logits(params, hidden, cfg).reshape(d, width, -1)
        tokens = plain_tokens(logits, window.drafts, sampling)                      # [D, W]
        agree = window.drafts == tokens[:, :-1]
        accepted = jnp.min(jnp.where(agree, width - 1, jnp.arange(width - 1)[None, :]), axis=1)
        stops = jnp.any(tokens[:, :, None] == window.stop_ids[:, None, :], axis=-1)
        first_stop = jnp.min(jnp.where(stops, jnp.arange(width)[None, :], width), axis=1)
        ran = jnp.minimum(jnp.minimum(accepted + 1, window.steps), first_stop + 1).astype(jnp.int32)
        captured = window.capture_row > 0              # at most one block boundary in a window of <= block_size
        capture_at = jnp.where(jnp.any(captured, axis=1), jnp.argmax(captured, axis=1), -1)
        buffers = commit_positions(pending, ran - 1, pre.write_row, capture_at, jnp.max(window.capture_row, axis=1))
        logprobs = None
        if num_logprobs is not None:
            flat = token_logprobs(logits.reshape(d * width, -1), tokens.reshape(-1), num_logprobs)
            logprobs = jax.tree.map(lambda a: a.reshape(d, width, *a.shape[1:]), flat)
        return tokens, ran, buffers, logprobs

    return jax.jit(run, donate_argnums=(1,), static_argnames=("num_logprobs",))
