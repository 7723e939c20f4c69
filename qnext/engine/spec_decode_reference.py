"""Speculative decoding with the MTP head over the dense forward: the reference the engine's integration will be
held to, and what scripts/train_mtp.py measures acceptance with. Every round recomputes the whole sequence (no
cache), so it is slow by design; what it pins down is the bookkeeping:

    round: the sequence x_0..x_{T-1}; target hidden states h_0..h_{T-2} of its accepted tokens
      draft  d_1..d_k: the head on (x_1..x_{T-1}, h_0..h_{T-2}), then chained on its own drafts and hidden states
      verify the target on x_0..x_{T-1}, d_1..d_k: its k + 1 distributions at positions T-1 .. T-1+k
      accept (spec_decode.py) -> emit d_1..d_a and one more token; keep only the hidden states of accepted
             positions (a rejected draft's hidden state, like its KV and recurrent state, is never used again)
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qnext.config import ModelConfig
from qnext.engine.spec_decode import accept_greedy
from qnext.model.dense import dense_hidden
from qnext.model.mtp import mtp_forward

Draft = Callable[[list[int], jnp.ndarray, int], list[int]]   # (tokens, target hidden of all but the last, k) -> drafts


def _padded(tokens: list[int], length: int) -> jnp.ndarray:
    """[1, length]: right padding never changes earlier positions of a causal model, so one shape compiles."""
    if len(tokens) > length:
        raise ValueError(f"{len(tokens)} tokens do not fit the reference's fixed length {length}")
    return jnp.asarray([tokens + [0] * (length - len(tokens))], jnp.int32)


def mtp_draft(params, mtp, cfg: ModelConfig, length: int) -> Draft:
    """k greedy drafts from the MTP head, chained on its own outputs (sequences up to `length` tokens)."""
    forward = jax.jit(lambda ids, hidden: mtp_forward(params, mtp, ids, hidden, cfg))

    def draft(tokens: list[int], hidden, k: int) -> list[int]:
        ids, out = list(tokens[1:]), []
        hid = jnp.zeros((length, hidden.shape[-1]), hidden.dtype).at[:len(hidden)].set(hidden)
        for _ in range(k):
            logits, own = forward(_padded(ids, length), hid[None])
            slot = len(ids) - 1
            d = int(jnp.argmax(logits[0, slot]))
            out.append(d)
            ids.append(d)
            hid = hid.at[slot + 1].set(own[0, slot].astype(hid.dtype))
        return out

    return draft


def target_forward(params, cfg: ModelConfig):
    """The target's (hidden, logits) for [1, length] ids, jitted with the weights baked in: build it once and pass it
    as `target` to the calls below, which otherwise each compile their own."""
    return jax.jit(lambda ids: dense_hidden(params, ids, None, cfg))


def speculative_greedy(params, cfg: ModelConfig, prompt: list[int], max_tokens: int, k: int,
                       draft: Draft, length: int, target=None) -> tuple[list[int], list[int]]:
    """Greedy decoding of max_tokens tokens with k drafts a round, sequences padded to `length` (at least
    len(prompt) + max_tokens + k). Returns (tokens, drafts accepted per round)."""
    if target is None:
        target = target_forward(params, cfg)
    seq = list(prompt)
    hidden, logits = target(_padded(seq, length))
    seq.append(int(jnp.argmax(logits[0, len(prompt) - 1])))
    hidden = hidden[0, :len(prompt)]                          # h_0..h_{T-2} for T = len(seq)
    accepted = []
    while len(seq) - len(prompt) < max_tokens:
        t = len(seq)
        drafts = draft(seq, hidden, k)
        h_all, logits = target(_padded(seq + drafts, length))
        acc = accept_greedy(jnp.asarray([drafts]), logits[:, t - 1:t + k])
        n = int(acc.num_emitted[0])
        seq += np.asarray(acc.tokens[0, :n]).tolist()
        accepted.append(int(acc.num_accepted[0]))
        hidden = h_all[0, :len(seq) - 1]                     # accepted positions only
    return seq[len(prompt):len(prompt) + max_tokens], accepted


def plain_greedy(params, cfg: ModelConfig, prompt: list[int], max_tokens: int, length: int,
                 target=None) -> list[int]:
    if target is None:
        target = target_forward(params, cfg)
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(int(jnp.argmax(target(_padded(seq, length))[1][0, len(seq) - 1])))
    return seq[len(prompt):]
