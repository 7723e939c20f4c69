"""MTP speculative decoding's two jitted calls (docs/speculative.md).

The speculative step (`make_spec_step`), for a batch of decoding rows that each hold k drafts d_1..d_k from the MTP
head: one target pass over the window [x_{N-1}, d_1..d_k] of every row (qnext/model/verify.py: every position's
logits, the per-position recurrent and conv states kept aside) -> the acceptance rule (spec_decode.accept_rows) ->
each row keeps `ran` tokens: its accepted drafts and one more, cut at a stop token id and at the row's budget
(max_tokens, max_model_len, the blocks it holds) -> the state after the last kept position goes to the live row,
and a block boundary reached at a kept position is captured into its snapshot row -> the MTP head runs over the
same window (slot N-1+j takes the kept token j and the target's hidden state at N-1+j) and drafts the next k
tokens from its slot at the last kept position. The KV the target wrote for rejected positions lies past the
sequence's length, is never read, and the next step overwrites it.

The catch-up (`make_mtp_catch_up`), after any other step of an engine that drafts: the head's slots for the
positions that step computed (the next token of each: the prompt's, or the token just sampled), and k drafts for
every row that sampled. So the head's KV always covers the positions the target has computed, whichever step
computed them, and prefix caching, preemption and the host tier see one more KV layer and nothing else.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qnext.config import ModelConfig
from qnext.engine.sampler import SamplingTensors, token_logprobs
from qnext.engine.spec_decode import accept_rows
from qnext.engine.window import WindowInputs
from qnext.model.forward import decoder_stack, lm_logits
from qnext.model.mtp_step import draft_chain, mtp_layer, replace_kv
from qnext.model.norms import rms_norm
from qnext.model.step_inputs import RowGroups, StepInputs
from qnext.model.verify import commit_positions, verify_deltanet


def window_length(num_speculative_tokens: int, backend: str, rows: int = 1) -> int:
    """Positions of each of `rows` verify windows: k + 1 tokens, rounded up to a power of two on GPUs (the Pallas
    kernels' group shapes). On CPU, k + 1 while the step has at most 4 tokens, else rounded up so that the step's
    rows x length tokens are a multiple of 8: XLA:CPU's GEMM over the weights costs by groups of rows (this CPU,
    the small preset's weights at 1 / 4 / 5-7 / 8 / 9-12 / 16 rows: 15 / 19 / 30 / 24 / 39 / 34 ms), so 8 rows
    cost less than 5 and 16 less than 9 (a padding position is a token of length 0: KV slot 0, never kept)."""
    k = num_speculative_tokens
    if backend != "cpu":
        return 1 << k.bit_length()
    length = k + 1
    while rows * length > 4 and rows * length % 8:
        length += 1
    return length


@struct.dataclass
class ChainInputs:
    """Where each logits row of a catch-up drafts: its sequence's block table, and whether it drafts at all."""

    block_table: jnp.ndarray  # [M, MB] int32
    running: jnp.ndarray      # [M] bool


def verify_inputs(windows, read_rows, write_rows, tables, starts, rows: int, length: int, max_blocks: int,
                  block_size: int) -> StepInputs:
    """The verify layout (qnext/model/verify.py) on the host: row i's window tokens windows[i] at positions
    starts[i].., its block table, state rows; `rows` x `length` flat tokens."""
    t = rows * length
    token_ids, positions, slots = np.zeros(t, np.int32), np.zeros(t, np.int32), np.zeros(t, np.int32)
    g = dict(token_index=np.arange(t, dtype=np.int32).reshape(rows, length), length=np.zeros(rows, np.int32),
             block_table=np.zeros((rows, max_blocks), np.int32), kv_len=np.zeros(rows, np.int32),
             is_first=np.ones(rows, bool), is_last=np.ones(rows, bool), read_row=np.full(rows, -1, np.int32),
             write_row=np.zeros(rows, np.int32), capture_row=np.zeros(rows, np.int32))
    for i, (window, start, table) in enumerate(zip(windows, starts, tables)):
        n = len(window)
        lo = i * length
        pos = np.arange(start, start + n)
        table = np.asarray(table, np.int64)
        token_ids[lo:lo + n] = window
        positions[lo:lo + n] = pos
        slots[lo:lo + n] = table[pos // block_size] * block_size + pos % block_size
        g["length"][i], g["kv_len"][i] = n, start + n
        g["block_table"][i, :len(table)] = table
        g["read_row"][i], g["write_row"][i] = read_rows[i], write_rows[i]
    empty = RowGroups(token_index=np.zeros((0, 1), np.int32), length=np.zeros(0, np.int32),
                      block_table=np.zeros((0, max_blocks), np.int32), kv_len=np.zeros(0, np.int32),
                      is_first=np.zeros(0, bool), is_last=np.zeros(0, bool), read_row=np.zeros(0, np.int32),
                      write_row=np.zeros(0, np.int32), capture_row=np.zeros(0, np.int32))
    return StepInputs(token_ids=token_ids, positions=positions, slot_mapping=slots, decode=empty,
                      prefill=RowGroups(**g), token_source=np.arange(t, dtype=np.int32),
                      logits_index=np.arange(rows, dtype=np.int32) * length)


@functools.lru_cache(maxsize=None)
def make_spec_step(cfg: ModelConfig, num_speculative_tokens: int, block_size: int, with_head: bool = True):
    """jit(params, mtp, buffers, inputs, window, sampling, num_logprobs=None) -> (tokens [D, k + 1] int32, ran [D]
    int32 tokens each row keeps, next drafts [D, k] int32, buffers, logprobs); sampling: the rows' SamplingTensors,
    or None when every row needs no tensors (plain greedy); num_logprobs (static): `sample`'s K for the emitted
    tokens' logprobs, a SamplerOutput whose fields are [D, k + 1, ...] (the target's raw logits at each window
    position, as plain decoding reports them), or None for none. Cache buffers are donated.
    with_head False (drafts chosen on the host, Drafter.uses_head): the verify pass alone; the head neither runs
    nor writes its KV, and the next drafts are zeros."""
    k = num_speculative_tokens

    def run(params, mtp, buffers, inputs: StepInputs, window: WindowInputs, sampling: SamplingTensors | None,
            num_logprobs: int | None = None):
        pre = inputs.prefill
        d, length = pre.token_index.shape
        x, pending = decoder_stack(params, buffers, inputs, cfg, linear_layer=verify_deltanet)
        hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)                 # [D * L, H]
        rows = hidden.reshape(d, length, -1)[:, :k + 1]
        logits = lm_logits(params, rows.reshape(d * (k + 1), -1), cfg).reshape(d, k + 1, -1)
        acc = accept_rows(logits, window.drafts, sampling)
        stops = jnp.any(acc.tokens[:, :, None] == window.stop_ids[:, None, :], axis=-1)   # [D, k + 1]
        first_stop = jnp.min(jnp.where(stops, jnp.arange(k + 1)[None, :], k + 1), axis=1)
        ran = jnp.minimum(jnp.minimum(acc.num_emitted, window.steps), first_stop + 1)
        keep = ran - 1
        captured = window.capture_row > 0              # at most one block boundary in a window of <= block_size
        capture_at = jnp.where(jnp.any(captured, axis=1), jnp.argmax(captured, axis=1), -1)
        capture_row = jnp.max(window.capture_row, axis=1)
        buffers = commit_positions(pending, keep, pre.write_row, capture_at, capture_row)

        logprobs = None
        if num_logprobs is not None:
            flat = token_logprobs(logits.reshape(d * (k + 1), -1), acc.tokens.reshape(-1), num_logprobs)
            logprobs = jax.tree.map(lambda x: x.reshape(d, k + 1, *x.shape[1:]), flat)
        if not with_head:
            return acc.tokens, ran, jnp.zeros((d, k), jnp.int32), buffers, logprobs
        # the head over the window: slot j takes kept token j (later slots are provisional, overwritten later)
        next_ids = jnp.concatenate([acc.tokens, jnp.repeat(acc.tokens[:, -1:], length - k - 1, axis=1)], axis=1)
        own, kv = mtp_layer(params, mtp, buffers.kv[-1], next_ids.reshape(-1), hidden, inputs, cfg)
        last = jnp.arange(d) * length + jnp.maximum(keep, 0)
        drafts, kv = draft_chain(params, mtp, kv, own[last], inputs.positions[last], pre.block_table, ran > 0, k,
                                 cfg, block_size, 1)
        return acc.tokens, ran, drafts, replace_kv(buffers, kv), logprobs

    return jax.jit(run, donate_argnums=(2,), static_argnames=("num_logprobs",))


@functools.lru_cache(maxsize=None)
def make_mtp_catch_up(cfg: ModelConfig, num_speculative_tokens: int, block_size: int):
    """jit(params, mtp, buffers, inputs, next_ids [T], hidden [T, H], chain) -> (drafts [M, k] int32, buffers):
    the head's slots for every flat token of a step the target just ran (inputs: that step's), next_ids the token
    after each; drafts from each logits row whose chain.running is set. Cache buffers are donated."""

    def run(params, mtp, buffers, inputs: StepInputs, next_ids, hidden, chain: ChainInputs):
        own, kv = mtp_layer(params, mtp, buffers.kv[-1], next_ids, hidden, inputs, cfg)
        index = inputs.logits_index
        drafts, kv = draft_chain(params, mtp, kv, own[index], inputs.positions[index], chain.block_table,
                                 chain.running, num_speculative_tokens, cfg, block_size, 1)
        return drafts, replace_kv(buffers, kv)

    return jax.jit(run, donate_argnums=(2,))


@functools.lru_cache(maxsize=None)
def make_mtp_kv_catch_up(cfg: ModelConfig):
    """jit(params, mtp, buffers, inputs, next_ids [T], hidden [T, H]) -> buffers: make_mtp_catch_up's head slots
    (the head's KV for every flat token of the step) without drafting, for steps too large to speculate
    (speculative_config's disable_by_batch_size): no chain, no lm_head. Cache buffers are donated."""

    def run(params, mtp, buffers, inputs: StepInputs, next_ids, hidden):
        _, kv = mtp_layer(params, mtp, buffers.kv[-1], next_ids, hidden, inputs, cfg)
        return replace_kv(buffers, kv)

    return jax.jit(run, donate_argnums=(2,))
