"""Moving per-token tensors between the flat batch [T, ...] and the step's two group views."""
from __future__ import annotations

import jax.numpy as jnp

from qnext.model.step_inputs import StepInputs


def to_decode(x, inputs: StepInputs):
    """[T, ...] -> [D, ...] (one token per decode group)."""
    return x[inputs.decode.token_index[:, 0]]


def to_prefill(x, inputs: StepInputs):
    """[T, ...] -> [NC, C, ...]."""
    return x[inputs.prefill.token_index]


def from_groups(decode_out, prefill_out, inputs: StepInputs):
    """Per-group outputs back to the flat batch: [D, ...] and [NC, C, ...] -> [T, ...]."""
    rows = jnp.concatenate([decode_out, prefill_out.reshape((-1,) + prefill_out.shape[2:])], axis=0)
    return rows[inputs.token_source]


def query_positions(groups, positions):
    """Absolute positions of each group row, -1 on padding rows: [N, L]."""
    length = groups.token_index.shape[1]
    valid = jnp.arange(length)[None, :] < groups.length[:, None]
    return jnp.where(valid, positions[groups.token_index], -1)
