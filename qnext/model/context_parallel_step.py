"""The engine's context-parallel prefill step: one long prompt chunk split over `n` devices (mesh axis "context").

The step's one prefilling sequence is cut into n contiguous shards of ceil(tokens / n) (the last one shorter); each
device lays out its shard as an ordinary one-segment step (qnext/model/step_inputs.py: prefill groups, captures in
the shard, slots, the logits row of its last token) and runs the model's layers on it, with the parameters and the
whole cache buffers on every device (replicated), and two changes to the layers:

- full attention: the shards' new K/V (and their slots) are all-gathered before the write, so every device writes
  the whole chunk's KV into its pages (the same pages everywhere) and attends its own queries over them;
- Gated DeltaNet: the state entering the shard comes from the affine exchange of qnext/model/context_parallel.py
  (one state-sized all-gather per layer, from the segment's starting row), the conv's K-1 inputs before the shard
  from an all-gather of the shards' tails; a device > 0 places both in the sequence's write row, which its first
  group reads, and runs the ordinary kernels over its groups (so its captures are the kernels' own). The state rows
  written (captures, the write row) are then gathered from their owners and set on every device in shard order,
  the write row ending as the last shard's: the buffers stay equal on every device.

The logits come from the last shard (the prompt's last token). Numerics: float32 state; the entering state differs
from the sequential scan's by rounding of the fold (docs/long-context.md bounds what reaches the logits).
Narrow snapshot pools (staging, mamba_ssm_cache_dtype bfloat16) and pictures are not supported here: the engine
refuses the first at start and runs steps with pictures unsplit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.causal_conv1d import conv_silu
from qnext.config import ModelConfig
from qnext.model.argmax import first_argmax
from qnext.model.attention import full_attention
from qnext.model.context_parallel import shard_entry_state
from qnext.model.deltanet import delta_rule_inputs, deltanet_projections, gated_deltanet
from qnext.model.forward import decoder_stack, lm_logits
from qnext.model.host_devices import device_mesh
from qnext.model.norms import rms_norm
from qnext.model.step_inputs import LayoutSizes, Segment, StepInputs, build_step_inputs, required_sizes

AXIS = "context"


@struct.dataclass
class ShardRows:
    num_tokens: jnp.ndarray       # [] int32 this shard's tokens (the rest of its layout is padding)
    first_read_row: jnp.ndarray   # [] int32 the state row before the first shard (-1: the zero state)
    entry_row: jnp.ndarray        # [] int32 where a device > 0 places the state entering its shard (the write row)


def context_mesh(n: int) -> Mesh:
    return device_mesh(n, "context_parallel_size", AXIS)


def replicated(tree, n: int):
    """Arrays placed whole on each of the n context-parallel devices (a no-op for arrays already there)."""
    return jax.device_put(tree, NamedSharding(context_mesh(n), P()))


def shard_layout(segment: Segment, n: int, sizes: LayoutSizes, *, block_size: int, chunk: int,
                 extra_groups: int) -> tuple[StepInputs, ShardRows] | None:
    """Host layout of one prefilling segment over n shards, stacked on a leading axis of n; None when the segment
    is too short to split (fewer than n * chunk tokens: every shard but the last then holds a whole group, at least
    the conv's K-1 inputs) or asks for every token's logits. `sizes`: the step's bucket; each shard's layout is
    1/n of its tokens, static per bucket."""
    tokens = len(segment.token_ids)
    if segment.all_logits or tokens < n * chunk:
        return None
    per_shard = -(-tokens // n)
    local_tokens = -(-sizes.num_tokens // n)
    local = LayoutSizes(num_tokens=local_tokens, num_decode=0, num_chunks=-(-local_tokens // chunk) + extra_groups,
                        max_blocks=sizes.max_blocks, num_logits=1)
    shards, rows = [], []
    for i in range(n):
        lo, hi = i * per_shard, min((i + 1) * per_shard, tokens)
        start, end = segment.start + lo, segment.start + hi
        part = Segment(token_ids=segment.token_ids[lo:hi], start=start, block_table=segment.block_table,
                       read_row=segment.read_row if i == 0 else segment.write_row, write_row=segment.write_row,
                       captures={p: r for p, r in segment.captures.items() if start < p <= end})
        if not local.fits(required_sizes([part], chunk)):        # captures cut it into more groups than planned
            return None
        shards.append(build_step_inputs([part], local, block_size=block_size, chunk=chunk))
        rows.append(ShardRows(num_tokens=np.int32(hi - lo), first_read_row=np.int32(segment.read_row),
                              entry_row=np.int32(segment.write_row)))
    return jax.tree.map(lambda *xs: np.stack(xs), *shards), jax.tree.map(lambda *xs: np.stack(xs), *rows)


def _all_shards_kv(k, v, slot_mapping):
    """Every shard's new keys, values and slots (the pages every device writes)."""
    return tuple(jax.lax.all_gather(t, AXIS, tiled=True) for t in (k, v, slot_mapping))


def _share_written_rows(conv, recurrent, inputs: StepInputs, n: int):
    """The state rows each device's kernels wrote (captures; the write row) set on every device, in shard order."""
    pre = inputs.prefill
    nowhere = conv.shape[0]                               # out of range: dropped (row 0 stays the zero state)
    rows = jnp.concatenate([pre.capture_row, jnp.where(pre.is_last, pre.write_row, 0)])
    rows = jnp.where(rows > 0, rows, nowhere)
    read = jnp.minimum(rows, nowhere - 1)
    all_rows = jax.lax.all_gather(rows, AXIS)
    all_conv, all_recurrent = jax.lax.all_gather(conv[read], AXIS), jax.lax.all_gather(recurrent[read], AXIS)
    for i in range(n):                                    # the last shard's write row (the sequence's end) wins
        conv = conv.at[all_rows[i]].set(all_conv[i], mode="drop")
        recurrent = recurrent.at[all_rows[i]].set(all_recurrent[i], mode="drop")
    return conv, recurrent


def shard_deltanet(p, x, conv_state, recurrent_state, inputs: StepInputs, cfg: ModelConfig, *, shard: ShardRows,
                   n: int):
    """A Gated DeltaNet layer over this device's shard x [L, H] (decoder_stack's linear_layer)."""
    here = jax.lax.axis_index(AXIS)
    halo_len = cfg.linear_conv_kernel_dim - 1
    mixed, _, b, a = deltanet_projections(p, x, cfg)
    tails = jax.lax.all_gather(jax.lax.dynamic_slice_in_dim(mixed, shard.num_tokens - halo_len, halo_len, 0), AXIS)
    first = jnp.maximum(shard.first_read_row, 0)         # -1 reads row 0, the zero state, as the kernels do
    halo = jnp.where(here == 0, conv_state[first].astype(mixed.dtype), tails[jnp.maximum(here - 1, 0)])
    q, k, v, g, beta = delta_rule_inputs(conv_silu(jnp.concatenate([halo, mixed]), p["conv_weight"]).astype(x.dtype),
                                         b, a, p, cfg)
    valid = jnp.arange(x.shape[0]) < shard.num_tokens    # padding rows leave the state as it is
    k = jnp.where(valid[:, None, None], k, 0.0)
    g, beta = jnp.where(valid[:, None], g, 0.0), jnp.where(valid[:, None], beta, 0.0)
    entering = shard_entry_state(q[None], k[None], v[None], g[None], beta[None], AXIS, recurrent_state[first][None])[0]
    # device 0 reads the segment's own row; row 0 (the zero state: warm-up's padding) is never written
    entry = jnp.where((here > 0) & (shard.entry_row > 0), shard.entry_row, conv_state.shape[0])
    conv_state = conv_state.at[entry].set(halo.astype(conv_state.dtype), mode="drop")
    recurrent_state = recurrent_state.at[entry].set(entering.astype(recurrent_state.dtype), mode="drop")
    out, conv_state, recurrent_state = gated_deltanet(p, x, conv_state, recurrent_state, inputs, cfg)
    return (out,) + _share_written_rows(conv_state, recurrent_state, inputs, n)


def _shard_forward(params, buffers, inputs: StepInputs, shard: ShardRows, cfg: ModelConfig, n: int):
    inputs, shard = jax.tree.map(lambda x: x[0], (inputs, shard))          # this device's [1, ...] -> [...]
    x, buffers = decoder_stack(params, buffers, inputs, cfg,
                               linear_layer=functools.partial(shard_deltanet, shard=shard, n=n),
                               attention_layer=functools.partial(full_attention, new_kv=_all_shards_kv))
    logits = lm_logits(params, rms_norm(x[inputs.logits_index], params["final_norm"], cfg.rms_norm_eps), cfg)
    logits = jax.lax.all_gather(logits, AXIS)[n - 1]     # the last shard holds the prompt's last token
    return logits, first_argmax(logits), buffers


@functools.lru_cache(maxsize=None)
def make_context_parallel_step(cfg: ModelConfig, n: int):
    """step(params, buffers, stacked shard inputs, stacked ShardRows) -> (logits [1, V], greedy [1], buffers), the
    params and buffers replicated over the n devices; buffers donated."""
    # check_vma off: the kernels' loops carry per-device values next to replicated ones (as tensor_parallel.py)
    step = jax.shard_map(functools.partial(_shard_forward, cfg=cfg, n=n), mesh=context_mesh(n),
                         in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=(P(), P(), P()), check_vma=False)
    return jax.jit(step, donate_argnums=(1,))
