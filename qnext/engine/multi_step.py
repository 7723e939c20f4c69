"""Several decode steps in one jitted call (vLLM's num_scheduler_steps): the host schedules, lays out and
transfers once for up to K steps, and reads the K tokens of every row back once.

Inside the call, step k runs the decode bucket's forward on the tokens step k-1 picked, one position further. The
pick is the argmax of the raw logits when every row is greedy (the sampler's greedy pick), else the sampler's own
draw from the same tensors with the output position advanced by k: a row's token at a position depends only on its
key and that position, so the tokens are those single steps draw. Rows whose sampling needs per-step host state
(logprobs, penalties, suppressed ids) or stop strings do not come here.

Positions, kv lengths and KV slots advance on device from the block table, which the host has extended beforehand
for every token a row may run; so do the MRoPE positions of a sequence with pictures (step 0's, token index + the
sequence's position delta on all three axes, laid out by the runner's visual encoder). A row stops running after
`steps[i]` tokens (its max_tokens / max_model_len budget, capped by the blocks it holds) or after the token that
stops it (an EOS or stop token id, as check_stop; a row still short of min_tokens has those ids suppressed and does
not come here): from then on it is a padding row, which writes no state, conv row or capture, and its KV goes to
the dummy block. The host replays the same stop checks on the returned tokens, so no token past a stop is kept.
Snapshot captures at block boundaries happen in the step that computes the boundary's last token, into the row the
host passed for that step. The loop ends early once no row runs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.plan import ScheduledSequence
from qnext.engine.sampler import SamplingTensors, sample
from qnext.engine.window import WindowInputs
from qnext.model.argmax import first_argmax
from qnext.model.buckets import Bucket
from qnext.model.forward import forward
from qnext.model.step_inputs import StepInputs, build_step_inputs
from qnext.model.tensor_parallel import local_config, shard_step


def _step_inputs(first: StepInputs, k, tokens, running, capture_row, block_size: int) -> StepInputs:
    """Step k's inputs from step 0's (a decode bucket: row i is flat token i and logits row i)."""
    dec = first.decode
    positions = first.positions + k
    table = dec.block_table
    rows = jnp.arange(table.shape[0])
    blocks = table[rows, jnp.minimum(positions // block_size, table.shape[1] - 1)]
    slots = jnp.where(running, blocks * block_size + positions % block_size, 0)
    read_row = jnp.where(k == 0, dec.read_row, dec.write_row)          # after step 0 each row reads its own row
    # a row of a sequence with pictures carries its MRoPE delta: text positions + delta on all three axes
    rope = None if first.rope_positions is None else first.rope_positions + k
    return dataclasses.replace(
        first, token_ids=jnp.where(k == 0, first.token_ids, tokens), positions=positions, slot_mapping=slots,
        rope_positions=rope,
        decode=dataclasses.replace(dec, kv_len=dec.kv_len + k, read_row=jnp.where(running, read_row, -1),
                                   write_row=jnp.where(running, dec.write_row, 0),
                                   capture_row=jnp.where(running, capture_row, 0)))


@functools.lru_cache(maxsize=None)
def make_multi_step(cfg: ModelConfig, num_steps: int, block_size: int, tensor_parallel_size: int = 1):
    """jit(params, buffers, inputs, window, sampling) -> (tokens [D, K] int32, ran [D] int32 steps each row ran,
    buffers); sampling: the rows' SamplingTensors, or None when every row is greedy. Cache buffers are donated.
    With tensor_parallel_size > 1, each device runs its shard of the model and all of the rest (as make_engine_step)."""
    local = local_config(cfg, tensor_parallel_size)

    def run(params, buffers, inputs: StepInputs, window: WindowInputs, sampling: SamplingTensors | None):
        d = window.steps.shape[0]

        def pick(logits, k):
            if sampling is None:
                return first_argmax(logits)[:d]
            return sample(logits[:d], sampling._replace(position=sampling.position + k), num_logprobs=None).token_ids

        def body(carry):
            k, running, tokens, out, ran, buffers = carry
            step = _step_inputs(inputs, k, tokens, running, window.capture_row[:, k], block_size)
            logits, buffers = forward(params, buffers, step, local)
            picked = pick(logits, k)
            stops = jnp.any(picked[:, None] == window.stop_ids, axis=1)
            out = out.at[:, k].set(jnp.where(running, picked, -1))
            ran = ran + running
            running = running & ~stops & (k + 1 < window.steps)
            return k + 1, running, picked, out, ran, buffers

        def more(carry):
            return (carry[0] < num_steps) & jnp.any(carry[1])

        carry = (jnp.int32(0), window.steps > 0, inputs.token_ids, jnp.full((d, num_steps), -1, jnp.int32),
                 jnp.zeros(d, jnp.int32), buffers)
        _, _, _, out, ran, buffers = jax.lax.while_loop(more, body, carry)
        return out, ran, buffers

    return jax.jit(shard_step(run, cfg, tensor_parallel_size, 2), donate_argnums=(1,))


class MultiStep:
    """The runner's window step for num_scheduler_steps > 1 (the drafter's speculative step is the other)."""

    def __init__(self, cfg: ModelConfig, config: EngineConfig):
        self.width = config.num_scheduler_steps
        self.block_size = config.block_size
        self._run = make_multi_step(cfg, config.num_scheduler_steps, config.block_size, config.tensor_parallel_size)

    def layout(self, items: list[ScheduledSequence], bucket: Bucket, window: WindowInputs) -> StepInputs:
        """Step 0's inputs: the decode bucket's layout of each item's one token."""
        assert bucket.is_decode and bucket.sizes.num_decode == bucket.sizes.num_tokens, \
            "a multi-step call needs a decode bucket"
        return build_step_inputs([it.segment for it in items], bucket.sizes, block_size=self.block_size,
                                 chunk=bucket.chunk)

    def run(self, params, buffers, inputs: StepInputs, window: WindowInputs, sampling: SamplingTensors | None,
            num_logprobs: int | None):
        """-> (tokens [D, K], ran [D], buffers, no drafts, no logprobs): its rows ask for no logprobs."""
        assert num_logprobs is None, "multi-step rows report no logprobs"
        tokens, ran, buffers = self._run(params, buffers, inputs, window, sampling)
        return tokens, ran, buffers, None, None
