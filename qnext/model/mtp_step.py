"""The MTP head inside the engine's steps: the same math as qnext/model/mtp.py's dense `mtp_forward`, over the flat
batch of a step with the head's attention KV paged in the cache (the KV layer after the model's own).

Slot t of a sequence pairs the token x_{t+1} with the target's final-normed hidden state h_t, sits at position t
(its KV goes to position t's slot of the sequence's block table) and predicts x_{t+2}. A step that computed the
target's positions [s, e) computes the head's slots [s, e) with the same StepInputs, the token ids shifted by one:
the head's KV is thus always written for the positions the target has computed, and nothing else is kept. Drafting
k tokens chains k - 1 more one-slot passes on the head's own draft and normed hidden state, at the positions after
the last slot; those slots' KV is provisional (positions past the sequence's computed tokens) and is overwritten
when the target reaches them.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from qnext.config import ModelConfig
from qnext.model.argmax import first_argmax
from qnext.model.attention import full_attention
from qnext.model.forward import lm_logits
from qnext.ops.linear import linear
from qnext.model.mlp import feed_forward
from qnext.model.norms import rms_norm
from qnext.model.step_inputs import RowGroups, StepInputs


def mtp_layer(params, mtp, kv, next_ids, hidden, inputs: StepInputs, cfg: ModelConfig):
    """next_ids [T] (x_{t+1} of each flat token's slot), hidden [T, H] (h_t). Returns (the head's normed hidden
    [T, H], kv with the slots' keys and values written)."""
    eps = cfg.rms_norm_eps
    e = rms_norm(params["embed"][next_ids], mtp["pre_fc_norm_embedding"], eps)
    h = rms_norm(hidden, mtp["pre_fc_norm_hidden"], eps)
    x = linear(jnp.concatenate([e, h.astype(e.dtype)], axis=-1), mtp["fc"])
    layer = mtp["layer"]
    out, kv = full_attention(layer["attn"], rms_norm(x, layer["input_norm"], eps), kv, inputs, cfg)
    x = x + out
    x = x + feed_forward(layer["mlp"], rms_norm(x, layer["post_attn_norm"], eps), cfg, 0)
    return rms_norm(x, mtp["norm"], eps), kv


def one_slot_inputs(tokens, positions, block_table, running, block_size: int, chunk: int) -> StepInputs:
    """StepInputs of one decode slot per row, built on device: tokens, positions [D] int32, block_table [D, MB].
    Rows not running (or whose position has no block) write their KV to the dummy slot 0."""
    d, max_blocks = block_table.shape
    rows = jnp.arange(d)
    page = positions // block_size
    has_block = running & (page < max_blocks)
    block = block_table[rows, jnp.minimum(page, max_blocks - 1)]
    slots = jnp.where(has_block & (block > 0), block * block_size + positions % block_size, 0)
    zeros = jnp.zeros(d, jnp.int32)
    decode = RowGroups(token_index=rows[:, None].astype(jnp.int32), length=jnp.ones(d, jnp.int32),
                       block_table=block_table, kv_len=positions + 1, is_first=jnp.ones(d, bool),
                       is_last=jnp.ones(d, bool), read_row=zeros - 1, write_row=zeros, capture_row=zeros)
    empty = RowGroups(token_index=jnp.zeros((0, chunk), jnp.int32), length=jnp.zeros(0, jnp.int32),
                      block_table=jnp.zeros((0, max_blocks), jnp.int32), kv_len=jnp.zeros(0, jnp.int32),
                      is_first=jnp.zeros(0, bool), is_last=jnp.zeros(0, bool), read_row=jnp.zeros(0, jnp.int32),
                      write_row=jnp.zeros(0, jnp.int32), capture_row=jnp.zeros(0, jnp.int32))
    return StepInputs(token_ids=tokens, positions=positions, slot_mapping=slots, decode=decode, prefill=empty,
                      token_source=rows.astype(jnp.int32), logits_index=rows.astype(jnp.int32))


def draft_chain(params, mtp, kv, own_hidden, last_position, block_table, running, num_drafts: int,
                cfg: ModelConfig, block_size: int, chunk: int):
    """Greedy drafts [D, num_drafts] from the head's normed hidden state at each row's last slot (own_hidden [D, H],
    at last_position [D]), chained: draft j+1 comes from the slot after draft j's, fed draft j and the previous
    slot's own hidden state. Returns (drafts, kv)."""
    draft = draft_argmax(params, mtp, cfg)
    drafts = [draft(own_hidden)]
    hidden = own_hidden
    for j in range(1, num_drafts):
        inputs = one_slot_inputs(drafts[-1], last_position + j, block_table, running, block_size, chunk)
        hidden, kv = mtp_layer(params, mtp, kv, drafts[-1], hidden, inputs, cfg)
        drafts.append(draft(hidden))
    return jnp.stack(drafts, axis=1).astype(jnp.int32), kv


def draft_argmax(params, mtp, cfg: ModelConfig):
    """hidden [D, H] -> the head's greedy token [D] int32: over the whole vocabulary, or, when the head carries a
    draft vocabulary (mtp["draft_token_ids"], qnext/model/draft_vocab.py), over those ids only. Their lm_head rows
    are gathered once here, so a call drafting several tokens reads N x H weights per draft instead of V x H."""
    ids = mtp.get("draft_token_ids")
    if ids is None:
        return lambda hidden: first_argmax(lm_logits(params, hidden, cfg))
    head = params["lm_head"][ids]                                                   # [N, H]
    return lambda hidden: ids[first_argmax(linear(hidden, head, preferred_element_type=jnp.float32))]


def replace_kv(buffers, kv):
    """The buffers with their last KV layer (the MTP head's) replaced."""
    return dataclasses.replace(buffers, kv=buffers.kv[:-1] + (kv,))
