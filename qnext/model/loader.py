"""Hugging Face safetensors checkpoint -> weights pytree (docs/CONTRACTS.md).

Handles single-file and sharded checkpoints (read by checkpoint_tensors.py), block-quantised FP8 checkpoints as
released (dequantised here, in float32, before the leaf is combined; fp8_blocks.py; or with fp8_weights="keep" held
as e4m3 with block scales, fp8_keep.py), the Qwen3.5 VLM prefix `model.language_model.` (skipping
`model.visual.*` and `mtp.*`), Qwen3-Next's per-key-head interleaved `in_proj_qkvz` / `in_proj_ba`, Qwen3.5's split
GDN projections, per-head [q | gate] rows of `q_proj`, and per-expert or fused experts. Dense weights keep HF's
[out, in]; expert stacks become [E, in, out].
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qnext.config import ModelConfig
from qnext.model import converted_params_store
from qnext.model.checkpoint_tensors import (  # noqa: F401  (names the loader has always exported)
    INDEX_FILE, SINGLE_FILE, CheckpointError, Tensors as _Tensors, checkpoint_files)
from qnext.model.fp8_keep import FP8_WEIGHT_MODES, kept_expert_list, kept_expert_stack, kept_rows
from qnext.ops.fp8_weight import Fp8Weight
from qnext.model.weights import ParamSpec, as_dtype, map_specs, param_specs
from qnext.model.host_devices import engine_devices

log = logging.getLogger(__name__)

def load_params(
    path: str | Path, cfg: ModelConfig, dtype: Any = "float32", cache_dir: str | Path | None = None,
    fp8_weights: str = "dequantize",
) -> dict[str, Any]:
    """Loads the checkpoint in `path` as jax arrays committed to the default device (jitted outputs are committed:
    uncommitted params would compile each step shape once more after an engine's first update_weights).

    With `cache_dir`, the converted params are stored there with orbax, keyed by the checkpoint's path, file
    sizes and mtimes and the dtype, and a later load of the same checkpoint restores them without converting.
    fp8_weights: convert_checkpoint's (with "keep" the cache is not used: it stores plain arrays).
    """
    import jax

    dt = as_dtype(dtype)
    device = engine_devices()[0]
    key = None
    if cache_dir is not None and fp8_weights != "keep":
        key = converted_params_store.cache_key(path, dt)
        params = converted_params_store.restore_converted(cache_dir, key, cfg, dt)
        if params is not None:
            return jax.device_put(params, device)
    start = time.perf_counter()
    params = convert_checkpoint(path, cfg, dt, place=lambda a: jax.device_put(a, device), fp8_weights=fp8_weights)
    log.info("converted %s to %s in %.1f s", path, dt.name, time.perf_counter() - start)
    if key is not None:
        converted_params_store.save_converted(cache_dir, key, params)
    return params


def convert_checkpoint(
    path: str | Path, cfg: ModelConfig, dtype: Any = "float32", place: Callable[[np.ndarray], Any] | None = None,
    fp8_weights: str = "dequantize",
) -> dict[str, Any]:
    """Converts every tensor; returns numpy arrays, or `place(array)` per leaf as soon as it is built.

    fp8_weights="keep": a leaf made only of fp8 tensors stays e4m3 with its block scales (an Fp8Weight, fp8_keep.py)
    where its rows can be re-ordered block by block; every other leaf is dequantised in float32 and cast to `dtype`.

    Names and shapes of the whole checkpoint are checked before any tensor is read, and leaves are built one at
    a time, so host memory holds about one converted tensor beyond what `place` keeps.
    """
    specs = param_specs(cfg, dtype)
    with _Tensors(Path(path)) as t:
        plan = _plan(t, cfg)
        map_specs(lambda p, _: t.check(_at(plan, p).sources), specs)
        t.check_all_used()

        if fp8_weights not in FP8_WEIGHT_MODES:
            raise ValueError(f"fp8_weights must be one of {FP8_WEIGHT_MODES}, got {fp8_weights!r}")
        keep = fp8_weights == "keep" and t.fp8_block_size is not None

        def build(path_: tuple, spec: ParamSpec) -> Any:
            leaf = _at(plan, path_)
            kept = _kept(t, leaf, spec.dtype) if keep else None
            if kept is not None:
                assert kept.shape == spec.shape, (path_, kept.shape, spec.shape)
                return place(kept) if place is not None else kept
            arr = np.asarray(leaf.combine(*(t.read(name) for name, _ in leaf.sources)), dtype=spec.dtype)
            assert arr.shape == spec.shape, (path_, arr.shape, spec.shape)
            arr = np.ascontiguousarray(arr)
            return place(arr) if place is not None else arr

        return map_specs(build, specs)


def _kept(t, leaf: "_Leaf", dtype) -> Fp8Weight | None:
    names = [name for name, _ in leaf.sources]
    if not leaf.fp8_form or not any(t.is_fp8(n) for n in names):
        return None
    if leaf.fp8_form == "rows":   # fp8 sources with (in_proj) the release's bf16 ones, which become the tail
        parts = [t.read_fp8(n) if t.is_fp8(n) else (t.read(n), None) for n in names]
        return kept_rows(parts, leaf.combine, t.fp8_block_size, dtype)
    if not all(t.is_fp8(n) for n in names):
        return None
    if len(names) == 1:                                   # fused experts [E, out, in]
        return kept_expert_stack(*t.read_fp8(names[0]), t.fp8_block_size)
    per_expert = 2 if names[0].endswith("gate_proj.weight") else 1   # [gate_j, up_j]... or [down_j]...
    return kept_expert_list([t.read_fp8(n) for n in names], per_expert, t.fp8_block_size)


# ---- conversion plan -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One pytree leaf: the HF tensors it is made of (name, expected shape) and how to combine them."""

    sources: tuple[tuple[str, tuple[int, ...]], ...]
    combine: Callable[..., np.ndarray]
    fp8_form: str = ""   # how fp8_weights="keep" keeps it: "rows" (combine re-orders rows), "experts", "": never


def _same(name: str, *shape: int) -> _Leaf:
    return _Leaf(((name, shape),), lambda x: x, "rows" if len(shape) == 2 else "")


def _stacked_rows(*sources: tuple[str, tuple[int, ...]]) -> _Leaf:  # HF [out_i, in] blocks -> [sum out_i, in]
    return _Leaf(tuple(sources), lambda *xs: np.concatenate(xs, axis=0), "rows")


def _at(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _plan(t: "_Tensors", cfg: ModelConfig) -> dict[str, Any]:
    H, V = cfg.hidden_size, cfg.vocab_size
    tied = cfg.tie_word_embeddings or not t.has("lm_head.weight")
    if t.has("lm_head.weight"):
        t.check((("lm_head.weight", (V, H)),))  # unused when tied, as in transformers
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_norm": _same(p + "input_layernorm.weight", H),
            "post_attn_norm": _same(p + "post_attention_layernorm.weight", H),
            "attn": (_linear_attention if cfg.is_linear_layer(i) else _full_attention)(
                t, p + ("linear_attn." if cfg.is_linear_layer(i) else "self_attn."), cfg),
            "mlp": _moe(t, p + "mlp.", cfg) if cfg.is_moe_layer(i) else _dense_mlp(p + "mlp.", cfg),
        }
        layers.append(layer)
    return {
        "embed": _same("model.embed_tokens.weight", V, H),
        "final_norm": _same("model.norm.weight", H),
        "lm_head": _same("model.embed_tokens.weight" if tied else "lm_head.weight", V, H),
        "layers": tuple(layers),
    }


def _linear_attention(t: "_Tensors", p: str, cfg: ModelConfig) -> dict[str, _Leaf]:
    H, Hk, Hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk, cfg.linear_conv_kernel_dim
    if t.has(p + "in_proj_qkvz.weight"):
        # Qwen3-Next: rows grouped per key head g: [q_g (dk) | k_g (dk) | v of heads g*r.. (r*dv) | z of them (r*dv)],
        # and in_proj_ba per group: [b (r) | a (r)]. Re-ordered to q | k | v | z | b | a, each head-major.
        def deinterleave(qkvz: np.ndarray, ba: np.ndarray) -> np.ndarray:
            q, k, v, z = np.split(qkvz.reshape(Hk, 2 * dk + 2 * r * dv, H), np.cumsum([dk, dk, r * dv]), axis=1)
            b, a = np.split(ba.reshape(Hk, 2 * r, H), [r], axis=1)
            return np.concatenate([x.reshape(-1, H) for x in (q, k, v, z, b, a)], axis=0)

        in_proj = _Leaf(((p + "in_proj_qkvz.weight", (2 * cfg.key_dim + 2 * cfg.value_dim, H)),
                         (p + "in_proj_ba.weight", (2 * Hv, H))), deinterleave, "rows")
    else:
        # Qwen3.5: in_proj_qkv rows are already the conv channel order q | k | v.
        in_proj = _stacked_rows((p + "in_proj_qkv.weight", (cfg.conv_dim, H)),
                                   (p + "in_proj_z.weight", (cfg.value_dim, H)),
                                   (p + "in_proj_b.weight", (Hv, H)), (p + "in_proj_a.weight", (Hv, H)))
    return {
        "in_proj": in_proj,
        "conv_weight": _Leaf(((p + "conv1d.weight", (cfg.conv_dim, 1, K)),), lambda w: w[:, 0, :]),
        "A_log": _same(p + "A_log", Hv),
        "dt_bias": _same(p + "dt_bias", Hv),
        "norm": _same(p + "norm.weight", dv),
        "out_proj": _same(p + "out_proj.weight", H, cfg.value_dim),
    }


def _full_attention(t: "_Tensors", p: str, cfg: ModelConfig) -> dict[str, _Leaf]:
    H, Hq, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    # q_proj rows per head h: [query h (D) | output gate h (D)] -> q (head-major) | gate (head-major) | k | v
    def q_gate_k_v(q_proj: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        q_proj = q_proj.reshape(Hq, 2, D, *q_proj.shape[1:])
        q, gate = (q_proj[:, j].reshape(Hq * D, *q_proj.shape[3:]) for j in (0, 1))
        return np.concatenate([q, gate, k, v], axis=0)

    out = {
        "qkv_proj": _Leaf(((p + "q_proj.weight", (2 * Hq * D, H)), (p + "k_proj.weight", (Hkv * D, H)),
                           (p + "v_proj.weight", (Hkv * D, H))), q_gate_k_v, "rows"),
        "o_proj": _same(p + "o_proj.weight", H, Hq * D),
        "q_norm": _same(p + "q_norm.weight", D),
        "k_norm": _same(p + "k_norm.weight", D),
    }
    if cfg.attention_bias:
        out["qkv_bias"] = _Leaf(((p + "q_proj.bias", (2 * Hq * D,)), (p + "k_proj.bias", (Hkv * D,)),
                                 (p + "v_proj.bias", (Hkv * D,))), q_gate_k_v)
        out["o_bias"] = _same(p + "o_proj.bias", H)
    return out


def _dense_mlp(p: str, cfg: ModelConfig) -> dict[str, _Leaf]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {
        "gate_up": _stacked_rows((p + "gate_proj.weight", (I, H)), (p + "up_proj.weight", (I, H))),
        "down": _same(p + "down_proj.weight", H, I),
    }


def _moe(t: "_Tensors", p: str, cfg: ModelConfig) -> dict[str, _Leaf]:
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    swap = lambda x: x.transpose(0, 2, 1)  # noqa: E731  [E, out, in] -> [E, in, out]
    if t.has(p + "experts.gate_up_proj"):
        # fused (Qwen3.5-MoE releases): gate_up [E, 2I, H] with gate rows first, down [E, H, I]
        gate_up = _Leaf(((p + "experts.gate_up_proj", (E, 2 * I, H)),), swap, "experts")
        down = _Leaf(((p + "experts.down_proj", (E, H, I)),), swap, "experts")
    else:
        e = p + "experts."
        gate_up = _Leaf(
            tuple((f"{e}{j}.{w}_proj.weight", (I, H)) for j in range(E) for w in ("gate", "up")),
            lambda *m: swap(np.stack([np.concatenate(m[2 * j:2 * j + 2]) for j in range(E)])), "experts",
        )
        down = _Leaf(tuple((f"{e}{j}.down_proj.weight", (H, I)) for j in range(E)), lambda *m: swap(np.stack(m)),
                     "experts")
    return {
        "router": _same(p + "gate.weight", E, H),
        "experts_gate_up": gate_up,
        "experts_down": down,
        "shared_gate_up": _stacked_rows((p + "shared_expert.gate_proj.weight", (Is, H)),
                                           (p + "shared_expert.up_proj.weight", (Is, H))),
        "shared_down": _same(p + "shared_expert.down_proj.weight", H, Is),
        "shared_gate": _same(p + "shared_expert_gate.weight", 1, H),
    }


class _LayoutOnly:
    """Stands in for a checkpoint when only the plan's names and row orders are wanted (no tensor is read): the
    family's own DeltaNet projections (Qwen3-Next packed, Qwen3.5 split), per-expert experts, lm_head tied."""

    def __init__(self, packed_deltanet: bool):
        self._packed = packed_deltanet

    def has(self, name: str) -> bool:
        return self._packed and name.endswith("in_proj_qkvz.weight")

    def check(self, sources) -> None:
        pass


def family_plan(cfg: ModelConfig) -> dict[str, Any]:
    """The conversion plan of cfg's family without a checkpoint: per weights-pytree leaf, its HF tensors (name,
    shape) and the `combine` that orders their rows (used to place LoRA adapters on the fused leaves, qnext/lora)."""
    return _plan(_LayoutOnly(cfg.model_type == "qwen3_next"), cfg)
