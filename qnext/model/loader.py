"""Hugging Face safetensors checkpoint -> weights pytree (docs/CONTRACTS.md).

Handles single-file and sharded checkpoints, block-quantised FP8 checkpoints as released (dequantised here, in
float32, before the leaf is combined; fp8_blocks.py), the Qwen3.5 VLM prefix `model.language_model.` (skipping
`model.visual.*` and `mtp.*`), Qwen3-Next's per-key-head interleaved `in_proj_qkvz` / `in_proj_ba`, Qwen3.5's split
GDN projections, per-head [q | gate] rows of `q_proj`, and per-expert or fused experts. Dense weights keep HF's
[out, in]; expert stacks become [E, in, out].
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qnext.config import ModelConfig, read_json
from qnext.model import converted_cache
from qnext.model.fp8_blocks import Fp8Scheme, dequantize, quantization_problem, scale_name
from qnext.model.safetensors_fp8 import FLOAT8_DTYPES, Float8File
from qnext.model.weights import ParamSpec, as_dtype, map_specs, param_specs
from qnext.model.host_devices import engine_devices

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_VLM_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, unexpected or mis-shaped tensors, missing files."""


def load_params(
    path: str | Path, cfg: ModelConfig, dtype: Any = "float32", cache_dir: str | Path | None = None
) -> dict[str, Any]:
    """Loads the checkpoint in `path` as jax arrays committed to the default device (jitted outputs are committed:
    uncommitted params would compile each step shape once more after an engine's first update_weights).

    With `cache_dir`, the converted params are stored there with orbax, keyed by the checkpoint's path, file
    sizes and mtimes and the dtype, and a later load of the same checkpoint restores them without converting.
    """
    import jax

    dt = as_dtype(dtype)
    device = engine_devices()[0]
    key = None
    if cache_dir is not None:
        key = converted_cache.cache_key(path, dt)
        params = converted_cache.restore_converted(cache_dir, key, cfg, dt)
        if params is not None:
            return jax.device_put(params, device)
    start = time.perf_counter()
    params = convert_checkpoint(path, cfg, dt, place=lambda a: jax.device_put(a, device))
    log.info("converted %s to %s in %.1f s", path, dt.name, time.perf_counter() - start)
    if key is not None:
        converted_cache.save_converted(cache_dir, key, params)
    return params


def convert_checkpoint(
    path: str | Path, cfg: ModelConfig, dtype: Any = "float32", place: Callable[[np.ndarray], Any] | None = None
) -> dict[str, Any]:
    """Converts every tensor; returns numpy arrays, or `place(array)` per leaf as soon as it is built.

    Names and shapes of the whole checkpoint are checked before any tensor is read, and leaves are built one at
    a time, so host memory holds about one converted tensor beyond what `place` keeps.
    """
    specs = param_specs(cfg, dtype)
    with _Tensors(Path(path)) as t:
        plan = _plan(t, cfg)
        map_specs(lambda p, _: t.check(_at(plan, p).sources), specs)
        t.check_all_used()

        def build(path_: tuple, spec: ParamSpec) -> Any:
            leaf = _at(plan, path_)
            arr = np.asarray(leaf.combine(*(t.read(name) for name, _ in leaf.sources)), dtype=spec.dtype)
            assert arr.shape == spec.shape, (path_, arr.shape, spec.shape)
            arr = np.ascontiguousarray(arr)
            return place(arr) if place is not None else arr

        return map_specs(build, specs)


# ---- conversion plan -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One pytree leaf: the HF tensors it is made of (name, expected shape) and how to combine them."""

    sources: tuple[tuple[str, tuple[int, ...]], ...]
    combine: Callable[..., np.ndarray]


def _same(name: str, *shape: int) -> _Leaf:
    return _Leaf(((name, shape),), lambda x: x)


def _stacked_rows(*sources: tuple[str, tuple[int, ...]]) -> _Leaf:  # HF [out_i, in] blocks -> [sum out_i, in]
    return _Leaf(tuple(sources), lambda *xs: np.concatenate(xs, axis=0))


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
                         (p + "in_proj_ba.weight", (2 * Hv, H))), deinterleave)
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
                           (p + "v_proj.weight", (Hkv * D, H))), q_gate_k_v),
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
        gate_up = _Leaf(((p + "experts.gate_up_proj", (E, 2 * I, H)),), swap)
        down = _Leaf(((p + "experts.down_proj", (E, H, I)),), swap)
    else:
        e = p + "experts."
        gate_up = _Leaf(
            tuple((f"{e}{j}.{w}_proj.weight", (I, H)) for j in range(E) for w in ("gate", "up")),
            lambda *m: swap(np.stack([np.concatenate(m[2 * j:2 * j + 2]) for j in range(E)])),
        )
        down = _Leaf(tuple((f"{e}{j}.down_proj.weight", (H, I)) for j in range(E)), lambda *m: swap(np.stack(m)))
    return {
        "router": _same(p + "gate.weight", E, H),
        "experts_gate_up": gate_up,
        "experts_down": down,
        "shared_gate_up": _stacked_rows((p + "shared_expert.gate_proj.weight", (Is, H)),
                                           (p + "shared_expert.up_proj.weight", (Is, H))),
        "shared_down": _same(p + "shared_expert.down_proj.weight", H, Is),
        "shared_gate": _same(p + "shared_expert_gate.weight", 1, H),
    }


# ---- reading safetensors -------------------------------------------------------------------------------------------
def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (from the index when sharded)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    index = path / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"shard {f.name} listed in {index} is missing from {path}")
        return files
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise CheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")


class _Tensors:
    """Name -> tensor over all files, with the VLM prefix stripped and skipped names dropped; tracks use."""

    def __init__(self, path: Path):
        self._path = path
        self._files = checkpoint_files(path)
        self._stack = contextlib.ExitStack()
        self._where: dict[str, tuple[Any, str, str]] = {}  # name -> (handle, original name, file name)
        self._used: set[str] = set()
        config = path / "config.json"
        self._fp8 = Fp8Scheme.from_hf_config(read_json(config)) if config.is_file() else None
        self._float8_files: dict[str, Float8File] = {}  # file name -> header, for the fp8 tensors' reads

    def __enter__(self) -> "_Tensors":
        from safetensors import safe_open

        for f in self._files:
            try:
                handle = self._stack.enter_context(safe_open(str(f), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read {f}: {e}") from None
            for original in handle.keys():
                if original.startswith(_SKIPPED_PREFIXES):
                    continue
                name = "model." + original[len(_VLM_PREFIX):] if original.startswith(_VLM_PREFIX) else original
                if name in self._where:
                    raise CheckpointError(f"tensor {original!r} appears twice (in {self._where[name][2]} and {f.name})")
                self._where[name] = (handle, original, f.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self._where

    def check(self, sources: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        """Each named tensor exists with the given shape; marks them used."""
        for name, shape in sources:
            if name not in self._where:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self._path}")
            handle, original, file = self._where[name]
            got = tuple(handle.get_slice(original).get_shape())
            if got != tuple(shape):
                raise CheckpointError(
                    f"tensor {original!r} in {file} has shape {got}; the config expects {tuple(shape)}"
                )
            self._check_quantization(name, got, handle.get_slice(original).get_dtype())
            self._used.add(name)

    def _check_quantization(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        """fp8_blocks.quantization_problem, as a CheckpointError naming the tensor; a checked scale is marked used."""
        _, original, file = self._where[name]
        scale = self._where.get(scale_name(name))
        scale_shape = None if scale is None else tuple(scale[0].get_slice(scale[1]).get_shape())
        problem = quantization_problem(self._fp8, name, shape, dtype, dtype in FLOAT8_DTYPES, scale_shape)
        if problem:
            raise CheckpointError(f"tensor {original!r} in {file} {problem}")
        if dtype in FLOAT8_DTYPES:
            self._used.add(scale_name(name))

    def read(self, name: str) -> np.ndarray:
        handle, original, file = self._where[name]
        if handle.get_slice(original).get_dtype() not in FLOAT8_DTYPES:
            return handle.get_tensor(original)
        if file not in self._float8_files:
            self._float8_files[file] = Float8File(self._path / file)
        s_handle, s_original, _ = self._where[scale_name(name)]
        return dequantize(self._float8_files[file].read(original), s_handle.get_tensor(s_original),
                          self._fp8.block_size)

    def check_all_used(self) -> None:
        unused = [n for n in self._where if n not in self._used]
        if unused:
            _, original, file = self._where[unused[0]]
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            raise CheckpointError(
                f"unexpected tensor {original!r} in {file}{more}; does the config match the checkpoint?"
            )
