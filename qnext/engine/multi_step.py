"""Several decode steps in one jitted call (vLLM's num_scheduler_steps): the host schedules, lays out and
transfers once for up to K steps, and reads the K tokens of every row back once.

Inside the call, step k runs the decode bucket's forward on the tokens step k-1 picked, one position further. The
pick is the argmax of the raw logits when every row is greedy (the sampler's greedy pick), else the sampler's own
draw from the same tensors with the output position advanced by k: a row's token at a position depends only on its
key and that position, so the tokens are those single steps draw. Rows whose sampling needs per-step host state
(logprobs, penalties, suppressed ids) or stop strings do not come here.

Positions, kv lengths and KV slots advance on device from the block table, which the host has extended beforehand
for every token a row may run. A row stops running after `steps[i]` tokens (its max_tokens / max_model_len budget,
capped by the blocks it holds) or after the token that stops it (an EOS or stop token id, as check_stop; a row still
short of min_tokens has those ids suppressed and does not come here): from then on it is a padding row, which writes
no state, conv row or capture, and its KV goes to the dummy block. The host replays the same stop checks on the
returned tokens, so no token past a stop is kept. Snapshot captures at block boundaries happen in the step that
computes the boundary's last token, into the row the host passed for that step. The loop ends early once no row
runs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qnext.config import ModelConfig
from qnext.engine.sampler import SamplingTensors, sample
from qnext.model.argmax import first_argmax
from qnext.model.forward import forward
from qnext.model.step_inputs import StepInputs
from qnext.model.tensor_parallel import local_config, shard_step


@struct.dataclass
class MultiStepInputs:
    """Per-row plan of one multi-step call over a decode bucket of D rows, K steps."""

    steps: jnp.ndarray          # [D] int32 tokens the row may run (0: padding row)
    capture_row: jnp.ndarray    # [K, D] int32 snapshot row for the state after step k's token; 0 = none
    stop_ids: jnp.ndarray       # [D, S] int32 token ids that end the row (-1: unused)

    @classmethod
    def idle(cls, num_steps: int, rows: int, stop_width: int = 4) -> "MultiStepInputs":
        """A plan in which no row runs (host numpy arrays, filled in by the caller)."""
        return cls(steps=np.zeros(rows, np.int32), capture_row=np.zeros((num_steps, rows), np.int32),
                   stop_ids=np.full((rows, stop_width), -1, np.int32))


def _step_inputs(first: StepInputs, k, tokens, running, capture_row, block_size: int) -> StepInputs:
    """Step k's inputs from step 0's (a decode bucket: row i is flat token i and logits row i)."""
    dec = first.decode
    positions = first.positions + k
    table = dec.block_table
    rows = jnp.arange(table.shape[0])
    blocks = table[rows, jnp.minimum(positions // block_size, table.shape[1] - 1)]
    slots = jnp.where(running, blocks * block_size + positions % block_size, 0)
    read_row = jnp.where(k == 0, dec.read_row, dec.write_row)          # after step 0 each row reads its own row
    return dataclasses.replace(
        first, token_ids=jnp.where(k == 0, first.token_ids, tokens), positions=positions, slot_mapping=slots,
        decode=dataclasses.replace(dec, kv_len=dec.kv_len + k, read_row=jnp.where(running, read_row, -1),
                                   write_row=jnp.where(running, dec.write_row, 0),
                                   capture_row=jnp.where(running, capture_row, 0)))


@functools.lru_cache(maxsize=None)
def make_multi_step(cfg: ModelConfig, num_steps: int, block_size: int, tensor_parallel_size: int = 1):
    """jit(params, buffers, inputs, plan, sampling) -> (tokens [K, D] int32, ran [D] int32 steps each row ran,
    buffers); sampling: the rows' SamplingTensors, or None when every row is greedy. Cache buffers are donated.
    With tensor_parallel_size > 1, each device runs its shard of the model and all of the rest (as make_engine_step)."""
    local = local_config(cfg, tensor_parallel_size)

    def run(params, buffers, inputs: StepInputs, plan: MultiStepInputs, sampling: SamplingTensors | None):
        d = plan.steps.shape[0]

        def pick(logits, k):
            if sampling is None:
                return first_argmax(logits)[:d]
            return sample(logits[:d], sampling._replace(position=sampling.position + k), num_logprobs=None).token_ids

        def body(carry):
            k, running, tokens, out, ran, buffers = carry
            step = _step_inputs(inputs, k, tokens, running, plan.capture_row[k], block_size)
            logits, buffers = forward(params, buffers, step, local)
            picked = pick(logits, k)
            stops = jnp.any(picked[:, None] == plan.stop_ids, axis=1)
            out = out.at[k].set(jnp.where(running, picked, -1))
            ran = ran + running
            running = running & ~stops & (k + 1 < plan.steps)
            return k + 1, running, picked, out, ran, buffers

        def more(carry):
            return (carry[0] < num_steps) & jnp.any(carry[1])

        carry = (jnp.int32(0), plan.steps > 0, inputs.token_ids, jnp.full((num_steps, d), -1, jnp.int32),
                 jnp.zeros(d, jnp.int32), buffers)
        _, _, _, out, ran, buffers = jax.lax.while_loop(more, body, carry)
        return out, ran, buffers

    return jax.jit(shard_step(run, cfg, tensor_parallel_size, 2), donate_argnums=(1,))
