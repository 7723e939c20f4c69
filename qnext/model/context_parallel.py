"""Context-parallel prefill of the Gated DeltaNet over one mesh axis: the sequence in equal contiguous shards, one
per device, every device scanning its shard at once.

The delta rule is affine in its state. Over one shard (S_in the state entering it, t a token in it):
    S_t = P_t S_in + B_t,        o_t = S_t^T q_t = B_t^T q_t + S_in^T (P_t^T q_t)
B_t is the state reached from a zero start; P_t [dk, dk] is the shard's homogeneous map so far (the state reached
from S_in = I with v = 0). The columns of the state never mix, so ONE scan per device gives both: state columns
[B | P] from the initial state [0 | I] with values [v | 0], outputs [B_t^T q_t | P_t^T q_t].
The devices then exchange their shard's end (P, B): an all-gather of one [Hv, dk, dk + dv] array per sequence and
device (state-sized: the bytes do not depend on the length). Each device folds the shards before its own,
S_in(i) = P_{i-1} (... (P_0 S_0 + B_0) ...) + B_{i-1}, and corrects its outputs with one [dk] x [dk, dv] product per
token. The causal conv (width K) reads the K-1 inputs before the shard: a halo from the previous device (ppermute).
Cost: the scan carries dk + dv value columns instead of dv (about 2x the delta rule's state-side flops at dk = dv);
numerics: float32, differences from the sequential scan are rounding (tests/model/test_context_parallel.py bounds
them).

Attention's part (docs/long-context.md): the shards' K/V are all-gathered (the KV a prefill writes into the paged
cache anyway) and each device attends its own queries over the gathered keys, causal by position; no ring. The
engine's step over paged KV and state rows is qnext/model/context_parallel_step.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.causal_conv1d import conv_silu
from qnext.config import ModelConfig
from qnext.model.dense_delta_rule import CHUNK, dense_gated_delta_rule_with_state
from qnext.model.deltanet import delta_rule_inputs, deltanet_output, deltanet_projections

_HIGHEST = jax.lax.Precision.HIGHEST


def _shard_scan(q, k, v, g, beta, axis: str, initial_state, chunk: int):
    """This device's zero-state outputs B_t^T q_t, its mapped queries P_t^T q_t, the state entering its shard and
    the state after the last shard (module docstring)."""
    b, _, hv, dv = v.shape
    dk = q.shape[-1]
    v_ext = jnp.concatenate([v.astype(jnp.float32), jnp.zeros(v.shape[:3] + (dk,), jnp.float32)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, hv, dk, dk))
    s_ext0 = jnp.concatenate([jnp.zeros((b, hv, dk, dv), jnp.float32), eye], axis=-1)
    o_ext, s_ext = dense_gated_delta_rule_with_state(q, k, v_ext, g, beta, s_ext0, chunk)
    ends = jax.lax.all_gather(s_ext, axis)                               # [n, B, Hv, dk, dv + dk]: the exchange
    here = jax.lax.axis_index(axis)
    start = jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def fold(i, carry):                                                  # carry: (S entering shard i, S_in here)
        s, s_in = carry
        s_in = jnp.where(i == here, s, s_in)
        shard_b, shard_p = ends[i][..., :dv], ends[i][..., dv:]
        return jnp.matmul(shard_p, s, precision=_HIGHEST) + shard_b, s_in

    final, s_in = jax.lax.fori_loop(0, ends.shape[0], fold, (start, start))
    return o_ext[..., :dv], o_ext[..., dv:], s_in, final


def shard_delta_rule(q, k, v, g, beta, axis: str, initial_state=None, chunk: int = CHUNK):
    """Inside shard_map over `axis`: this device's shard of the delta rule (shapes as dense_gated_delta_rule, T the
    shard's length). initial_state [B, Hv, dk, dv]: the state before the first shard (None: zeros). Returns
    (o [B, T, Hv, dv], the state after the LAST shard, the same on every device), float32."""
    o_zero, q_mapped, s_in, final = _shard_scan(q, k, v, g, beta, axis, initial_state, chunk)
    o = o_zero + jnp.einsum("bthk,bhkv->bthv", q_mapped, s_in, precision=_HIGHEST)
    return o, final


def shard_entry_state(q, k, v, g, beta, axis: str, initial_state=None, chunk: int = CHUNK):
    """Inside shard_map over `axis`: the state [B, Hv, dk, dv] entering this device's shard, float32 (the engine's
    context-parallel step starts its own kernels from it: qnext/model/context_parallel_step.py). Rows past a
    shard's tokens must carry k = beta = g = 0, which leave the state as it is."""
    return _shard_scan(q, k, v, g, beta, axis, initial_state, chunk)[2]


def context_parallel_deltanet(p, x, cfg: ModelConfig, mesh: Mesh, axis: str = "context", chunk: int = CHUNK):
    """A Gated DeltaNet layer (params p) over x [B, T, H] with T split over mesh axis `axis` (T divisible by its
    size); zero initial state, no padding. Equals qnext.model.dense.dense_gated_deltanet with an all-true mask."""
    n = mesh.shape[axis]
    if x.shape[1] % n:
        raise ValueError(f"sequence length {x.shape[1]} does not split over the {n} devices of mesh axis {axis!r}; "
                         f"pad it to a multiple of {n}")
    halo_len = cfg.linear_conv_kernel_dim - 1

    def shard(p, x_local):
        mixed, z, beta_logits, a = deltanet_projections(p, x_local, cfg)
        tail = mixed[:, -halo_len:]                                      # the next shard's conv halo
        halo = jax.lax.ppermute(tail, axis, [(i, i + 1) for i in range(n - 1)])   # device 0 receives zeros
        mixed = conv_silu(jnp.concatenate([halo, mixed], axis=1), p["conv_weight"]).astype(x_local.dtype)
        q, k, v, g, beta = delta_rule_inputs(mixed, beta_logits, a, p, cfg)
        o, _ = shard_delta_rule(q, k, v, g, beta, axis, chunk=chunk)
        return deltanet_output(p, o, z, x_local.dtype, cfg)

    p = jax.device_put(p, NamedSharding(mesh, P()))             # replicated over the mesh (params may be committed
    x = jax.device_put(x, NamedSharding(mesh, P(None, axis)))   # to one device)
    # check_vma off: the shared chunked scan builds replicated loop carries (identity matrices) that meet
    # per-device values, as in tensor_parallel.py
    return jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(None, axis)), out_specs=P(None, axis),
                         check_vma=False)(p, x)
