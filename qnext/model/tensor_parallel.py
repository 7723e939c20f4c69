"""Tensor parallelism over heads (Megatron-style), for the devices of one host.

With tensor_parallel_size = tp, device r holds 1/tp of every layer's heads: the r-th part of each attention /
DeltaNet head group (query, gate, key and value heads; DeltaNet value heads v*r.. with the key heads they use) and
of the MLP's intermediate units, and the matching rows of the cache buffers (KV pages per kv head, conv channels,
recurrent state heads). Column-parallel projections (qkv_proj, in_proj, gate_up) produce the local heads, the
mixers run on them unchanged (the model code sees a config with 1/tp of the heads), and row-parallel projections
(o_proj, out_proj, down) produce partial sums that one all-reduce per mixer and per MLP adds up, in float32.
Embedding, norms and router are replicated; lm_head is split by vocab rows and the logits gathered whole, and
everything outside the layers (sampling included) runs replicated, so every device picks the same tokens.

On CPU the devices are XLA host devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, set before JAX
starts), which run their shards concurrently: the single-threaded parts of a step (the DeltaNet state update and
chunk loops, paged attention, the conv) then use every core, where one device runs them on one.

What is split is read from the params' declared logical axes (qnext/model/weights.py: "heads", "mlp", "vocab").
Fused projections declare their segments along that axis (qkv_proj: q | gate | k | v); sharding takes each
segment's r-th part for device r, so the weights are re-ordered once at load: device-major, then segment, then the
segment's own order (qnext/model/head_layout.py). A bias added after a row-parallel projection (o_bias) is divided
by tp (exact for powers of two), as every device adds it before the all-reduce.

Head counts that do not divide (vLLM's and SGLang's rule): when tp is a multiple of the KV heads (the flagship's 2
KV heads at TP8), each KV head is replicated over the tp / Hkv devices whose query heads use it; likewise DeltaNet
key heads over the devices whose value heads use them. `sharded_model_config` is the model as the devices split it
(those heads repeated, exact: a query head still reads the same keys and values), the params are expanded to it at
load, and the cache buffers are made for it, so each device holds whole heads and the math is unchanged.

Expert parallelism (`expert_parallel`, vLLM's enable_expert_parallel): the same devices split each MoE layer's
experts instead of their units; device r holds experts [r E/tp, (r+1) E/tp) whole. Tokens are already replicated
on every device (attention is tensor parallel, or whole on every device), so dispatch is local: every device routes
all tokens (the router is replicated, top-k and normalisation as without EP) and runs the copies that chose its
experts; the combine is the MLP's all-reduce that tensor parallelism already does (the shared expert's partial sums
ride in it). `attention_tensor_parallel=False` keeps the mixers (attention, DeltaNet) and their cache whole on every
device, so that only the MLPs / experts and lm_head are split (no all-reduce after a mixer).
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.ops.fp8_weight import Fp8Weight
from qnext.model.head_layout import device_major, repeat_heads
from qnext.model.host_devices import device_mesh
from qnext.model.weights import ParamSpec, map_specs, param_specs

logger = logging.getLogger("qnext.engine")

AXIS = "tp"

SPLIT_AXES = ("heads", "mlp", "vocab")   # the logical axes (ParamSpec.axes) that tensor parallelism splits


def _split_axis(spec: ParamSpec, cfg: ModelConfig) -> int | None:
    """The axis of the param that the devices split (at most one per param), or None: replicated. An expert stack
    splits its "expert" axis under expert parallelism; mixer params ("heads") stay whole without attention TP."""
    if cfg.expert_parallel and "expert" in spec.axes:
        return spec.axes.index("expert")
    names = SPLIT_AXES if cfg.attention_tensor_parallel else ("mlp", "vocab")
    split = [i for i, name in enumerate(spec.axes) if name in names]
    assert len(split) <= 1, f"a param splits at most one axis: {spec}"
    return split[0] if split else None


def parallel_config(cfg: ModelConfig, tp: int, expert_parallel: bool = False,
                    attention_tensor_parallel: bool = True) -> ModelConfig:
    """The global config with the engine's parallel layout (expert_parallel, attention_tensor_parallel), checked
    against the model at start: ValueError saying what cannot be split."""
    if (expert_parallel or not attention_tensor_parallel) and tp == 1:
        what = "enable_expert_parallel" if expert_parallel else "attention_tensor_parallel=False"
        raise ValueError(f"{what} needs tensor_parallel_size > 1 (the devices the experts or MLPs are split over)")
    if expert_parallel:
        if not cfg.num_experts:
            raise ValueError("enable_expert_parallel needs a MoE model; this one has no experts (num_experts=0)")
        if cfg.num_experts % tp:
            raise ValueError(f"enable_expert_parallel over tensor_parallel_size={tp} devices must divide the "
                             f"model's num_experts ({cfg.num_experts}): each device holds num_experts / {tp}")
    cfg = dataclasses.replace(cfg, expert_parallel=expert_parallel,
                              attention_tensor_parallel=attention_tensor_parallel)
    local_config(cfg, tp)             # every split divides: checked before anything is read
    return cfg


def _replicas(what: str, heads: int, tp: int) -> int:
    """How many devices hold each of `heads` heads: 1 when tp divides them, tp / heads when heads divide tp."""
    if heads % tp == 0:
        return 1
    if tp % heads == 0:
        return tp // heads
    raise ValueError(f"tensor_parallel_size={tp} must divide the model's {what} ({heads}) or be a multiple of it "
                     "(then each head is replicated over the devices that share it)")


def sharded_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model as `tp` devices split it: the global config with KV heads (and DeltaNet key heads) repeated so
    that tp divides them (module docstring). Equal to cfg when every head count divides. Raises ValueError, saying
    which count, when the heads cannot be split or shared."""
    if tp == 1 or not cfg.attention_tensor_parallel:
        return cfg
    for name in ("num_attention_heads", "linear_num_value_heads"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {name} ({getattr(cfg, name)})")
    kv = _replicas("num_key_value_heads", cfg.num_key_value_heads, tp)
    k = _replicas("linear_num_key_heads", cfg.linear_num_key_heads, tp) if cfg.linear_layer_ids else 1
    return dataclasses.replace(cfg, num_key_value_heads=cfg.num_key_value_heads * kv,
                               linear_num_key_heads=cfg.linear_num_key_heads * k)


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one device's shard of the model sees: 1/tp of the heads (of sharded_model_config), intermediate
    units and lm_head rows (its vocab_size is the device's part of the logits, gathered whole at the end of the
    step)."""
    if tp == 1:
        return cfg
    cfg = sharded_model_config(cfg, tp)
    sizes = {"vocab_size": cfg.vocab_size}
    if cfg.attention_tensor_parallel:
        sizes.update(num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                     linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads)
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):      # a layer with the dense MLP
        sizes["intermediate_size"] = cfg.intermediate_size
    if cfg.num_experts:
        sizes["num_experts" if cfg.expert_parallel else "moe_intermediate_size"] = (
            cfg.num_experts if cfg.expert_parallel else cfg.moe_intermediate_size)
        sizes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    for name, value in sizes.items():
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {name} ({value})")
    return dataclasses.replace(cfg, **{k: v // tp for k, v in sizes.items()}, tensor_parallel_size=tp)


def make_mesh(tp: int) -> Mesh:
    return device_mesh(tp, "tensor_parallel_size", AXIS)


def mixer_all_reduce(out, cfg: ModelConfig):
    """A mixer's output: the devices' partial sums added up under attention TP; whole already when the mixers run
    whole on every device (attention_tensor_parallel=False)."""
    return all_reduce(out, cfg) if cfg.attention_tensor_parallel else out


def all_reduce(partial, cfg: ModelConfig):
    """Sum of the devices' partial outputs of a row-parallel projection (identity without tensor parallelism)."""
    if cfg.tensor_parallel_size == 1:
        return partial
    return jax.lax.psum(partial.astype(jnp.float32), AXIS).astype(partial.dtype)


def gather_vocab(logits, cfg: ModelConfig):
    """Every device's logits [M, V / tp] -> the whole [M, V] on every device (identity without tensor parallelism)."""
    if cfg.tensor_parallel_size == 1:
        return logits
    return jax.lax.all_gather(logits, AXIS, axis=1, tiled=True)


def _spec(axis: int | None) -> P:
    return P() if axis is None else P(*([None] * axis), AXIS)


def partition_specs(cfg: ModelConfig) -> dict:
    """PartitionSpecs of the params tree, from the params' logical axes (weights.py)."""
    return map_specs(lambda _, spec: _spec(_split_axis(spec, cfg)), param_specs(cfg))


def buffer_specs(buffers: CacheBuffers, cfg: ModelConfig) -> CacheBuffers:
    """KV pages [Hkv, ...] by kv head, conv state [R, K-1, conv_dim] by channel, recurrent [R, Hv, dk, dv] by head;
    whole on every device without attention TP."""
    if not cfg.attention_tensor_parallel:
        return jax.tree.map(lambda _: P(), buffers)
    return buffers.replace(kv=tuple((_spec(0), _spec(0)) for _ in buffers.kv),
                           conv=tuple(_spec(2) for _ in buffers.conv),
                           recurrent=tuple(_spec(1) for _ in buffers.recurrent),
                           snapshot_conv=tuple(_spec(2) for _ in buffers.snapshot_conv),
                           snapshot_recurrent=tuple(_spec(1) for _ in buffers.snapshot_recurrent))


def replicate_heads(params, cfg: ModelConfig, tp: int):
    """Host params of cfg -> host params of sharded_model_config(cfg, tp): the K and V rows of qkv_proj / qkv_bias
    and the q and k rows of a DeltaNet's in_proj / conv_weight repeated per head (the same arrays when nothing is
    replicated)."""
    sharded = sharded_model_config(cfg, tp)
    kv = sharded.num_key_value_heads // cfg.num_key_value_heads
    k = sharded.linear_num_key_heads // cfg.linear_num_key_heads
    if kv == 1 and k == 1:
        return params
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    attn_segments = ([hq * d, hq * d, hkv * d, hkv * d], [(hq, 1), (hq, 1), (hkv, kv), (hkv, kv)])
    conv_segments = ([cfg.key_dim, cfg.key_dim, hv * dv], [(hk, k), (hk, k), (hv, 1)])
    in_segments = (conv_segments[0] + [hv * dv, hv, hv], conv_segments[1] + [(hv, 1)] * 3)
    layers = []
    for i, layer in enumerate(params["layers"]):
        attn = dict(layer["attn"])
        if cfg.is_linear_layer(i):
            attn["in_proj"] = repeat_heads(attn["in_proj"], 0, *in_segments, f"layers.{i}.attn.in_proj", tp)
            attn["conv_weight"] = repeat_heads(attn["conv_weight"], 0, *conv_segments)
        else:
            for name in ("qkv_proj", "qkv_bias"):
                if name in attn:
                    attn[name] = repeat_heads(attn[name], 0, *attn_segments, f"layers.{i}.attn.{name}", tp)
        layers.append({**layer, "attn": attn})
    return {**params, "layers": tuple(layers)}


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
    """Host (numpy) params of the global cfg -> device arrays, each device holding its shard: heads replicated
    where tp does not divide them (replicate_heads), fused params re-ordered device-major, biases added after an
    all-reduce divided by tp, every param placed with its sharding."""
    tp = mesh.shape[AXIS]
    params, cfg = replicate_heads(params, cfg, tp), sharded_model_config(cfg, tp)

    def place(path, spec: ParamSpec):
        leaf, axis = params, _split_axis(spec, cfg)
        for key in path:
            leaf = leaf[key]
        name = "/".join(map(str, path))
        if spec.segments is not None and axis is not None and spec.axes[axis] in SPLIT_AXES:   # segments' axis
            leaf = device_major(leaf, axis, list(spec.segments), tp, name)
        elif isinstance(leaf, Fp8Weight) and axis is not None:   # whole blocks on each device: checked
            leaf = device_major(leaf, axis, [leaf.shape[axis]], tp, name)
        if spec.after_reduce and cfg.attention_tensor_parallel:   # every device adds it before the all-reduce
            leaf = leaf / tp                                      # (exact for powers of two)
        return jax.device_put(leaf, NamedSharding(mesh, _spec(axis)))

    placed = map_specs(place, param_specs(cfg))
    log_device_bytes(placed)
    return placed


def device_bytes(params, expert_only: bool = False) -> dict:
    """Bytes of the params each device holds (its shards, summed), by device; expert stacks only with
    expert_only."""
    held: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if expert_only and "experts_" not in jax.tree_util.keystr(path):
            continue
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def log_device_bytes(params) -> None:
    weights, experts = device_bytes(params), device_bytes(params, expert_only=True)
    most = max(weights, key=weights.get)
    logger.info("weights: %.1f MiB on each of %d devices at most (%.1f MiB of it experts)", weights[most] / 2 ** 20,
                len(weights), experts.get(most, 0) / 2 ** 20)


def sharded_buffers(allocate, mesh: Mesh, cfg: ModelConfig) -> CacheBuffers:
    """The buffers `allocate()` would make, zeros made directly in their shards (no device holds them whole)."""
    shapes = jax.eval_shape(allocate)
    specs = buffer_specs(shapes, cfg)
    return jax.tree.map(lambda a, s: jnp.zeros(a.shape, a.dtype, device=NamedSharding(mesh, s)), shapes, specs)


def shard_step(fn, cfg: ModelConfig, tp: int, num_replicated: int):
    """fn(params, buffers, *rest) -> (*replicated outputs, buffers), run as one shard per device on `tp` devices
    (fn sees one device's shard: the local config's shapes; cfg is the global one). `num_replicated`: the outputs
    before the buffers."""
    if tp == 1:
        return fn
    mesh = make_mesh(tp)
    pspecs = partition_specs(sharded_model_config(cfg, tp))

    def sharded(params, buffers, *rest):
        bspec = buffer_specs(buffers, cfg)
        # check_vma off: the kernels' loops carry values that are per-device (the state) next to replicated ones
        return jax.shard_map(fn, mesh=mesh, in_specs=(pspecs, bspec) + (P(),) * len(rest),
                             out_specs=(P(),) * num_replicated + (bspec,), check_vma=False)(params, buffers, *rest)

    return sharded
