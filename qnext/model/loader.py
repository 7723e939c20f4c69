"""Hugging Face safetensors checkpoint -> weights pytree (docs/CONTRACTS.md).

Handles single-file and sharded checkpoints, the Qwen3.5 VLM prefix `model.language_model.` (skipping
`model.visual.*` and `mtp.*`), Qwen3-Next's per-key-head interleaved `in_proj_qkvz` / `in_proj_ba`, Qwen3.5's split
GDN projections, per-head [q | gate] rows of `q_proj`, and per-expert or fused experts. HF stores [out, in];
the pytree stores [in, out].
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qnext.config import ModelConfig, read_json
from qnext.model import converted_cache
from qnext.model.weights import ParamSpec, as_dtype, map_specs, param_specs

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
    """Loads the checkpoint in `path` as jax arrays on the default device.

    With `cache_dir`, the converted params are stored there with orbax, keyed by the checkpoint's path, file
    sizes and mtimes and the dtype, and a later load of the same checkpoint restores them without converting.
    """
    import jax.numpy as jnp

    dt = as_dtype(dtype)
    key = None
    if cache_dir is not None:
        key = converted_cache.cache_key(path, dt)
        params = converted_cache.restore_converted(cache_dir, key, cfg, dt)
        if params is not None:
            return params
    params = convert_checkpoint(path, cfg, dt, place=jnp.asarray)
    if key is not None:
        converted_cache.save_converted(cache_dir, key, params)
    return params


def convert_checkpoint(
    path: str | Path, cfg: ModelConfig, dtype: Any = "float32", place: Callable[[np.ndarray], Any] | None = None
) -> dict[str, Any]:
    """Reads and converts every tensor; returns numpy arrays, or `place(array)` per leaf as soon as it is built
    (so host memory holds one converted tensor at a time beyond the mmapped files)."""
    specs = param_specs(cfg, dtype)
    with _Tensors(Path(path)) as t:
        raw = _convert(t, cfg)
        t.check_all_used()

    def finish(path_: tuple, spec: ParamSpec) -> Any:
        node = raw
        for k in path_:
            node = node[k]
        arr = np.asarray(node, dtype=spec.dtype)
        assert arr.shape == spec.shape, (path_, arr.shape, spec.shape)
        return place(arr) if place is not None else np.ascontiguousarray(arr)

    return map_specs(finish, specs)


# ---- conversion ----------------------------------------------------------------------------------------------------
def _convert(t: "_Tensors", cfg: ModelConfig) -> dict[str, Any]:
    H, V = cfg.hidden_size, cfg.vocab_size
    embed = t.take("model.embed_tokens.weight", (V, H))
    lm_head = t.take("lm_head.weight", (V, H)) if t.has("lm_head.weight") else None
    if cfg.tie_word_embeddings or lm_head is None:
        lm_head = embed
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_norm": t.take(p + "input_layernorm.weight", (H,)),
            "post_attn_norm": t.take(p + "post_attention_layernorm.weight", (H,)),
        }
        if cfg.is_linear_layer(i):
            layer["attn"] = _linear_attention(t, p + "linear_attn.", cfg)
        else:
            layer["attn"] = _full_attention(t, p + "self_attn.", cfg)
        layer["mlp"] = _moe(t, p + "mlp.", cfg) if cfg.is_moe_layer(i) else _dense_mlp(t, p + "mlp.", cfg)
        layers.append(layer)
    return {
        "embed": embed,
        "final_norm": t.take("model.norm.weight", (H,)),
        "lm_head": lm_head.T,
        "layers": tuple(layers),
    }


def _linear_attention(t: "_Tensors", p: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    H, Hk, Hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk
    if t.has(p + "in_proj_qkvz.weight"):
        # Qwen3-Next: rows grouped per key head g: [q_g (dk) | k_g (dk) | v of heads g*r.. (r*dv) | z of them (r*dv)],
        # and in_proj_ba per group: [b (r) | a (r)]. Re-ordered to q | k | v | z | b | a, each head-major.
        qkvz = t.take(p + "in_proj_qkvz.weight", (2 * cfg.key_dim + 2 * cfg.value_dim, H))
        ba = t.take(p + "in_proj_ba.weight", (2 * Hv, H))
        qkvz = qkvz.reshape(Hk, 2 * dk + 2 * r * dv, H)
        ba = ba.reshape(Hk, 2 * r, H)
        cuts = np.cumsum([dk, dk, r * dv])
        q, k, v, z = np.split(qkvz, cuts, axis=1)
        b, a = np.split(ba, [r], axis=1)
        rows = [x.reshape(-1, H) for x in (q, k, v, z, b, a)]
    else:
        # Qwen3.5: in_proj_qkv rows are already the conv channel order q | k | v.
        rows = [
            t.take(p + "in_proj_qkv.weight", (cfg.conv_dim, H)),
            t.take(p + "in_proj_z.weight", (cfg.value_dim, H)),
            t.take(p + "in_proj_b.weight", (Hv, H)),
            t.take(p + "in_proj_a.weight", (Hv, H)),
        ]
    K = cfg.linear_conv_kernel_dim
    return {
        "in_proj": np.concatenate(rows, axis=0).T,
        "conv_weight": t.take(p + "conv1d.weight", (cfg.conv_dim, 1, K)).reshape(cfg.conv_dim, K),
        "A_log": t.take(p + "A_log", (Hv,)),
        "dt_bias": t.take(p + "dt_bias", (Hv,)),
        "norm": t.take(p + "norm.weight", (dv,)),
        "out_proj": t.take(p + "out_proj.weight", (H, cfg.value_dim)).T,
    }


def _full_attention(t: "_Tensors", p: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    H, Hq, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # q_proj rows per head h: [query h (D) | output gate h (D)] -> columns q (head-major) | gate (head-major)
    q_gate = t.take(p + "q_proj.weight", (2 * Hq * D, H)).reshape(Hq, 2, D, H)
    rows = [
        q_gate[:, 0].reshape(Hq * D, H),
        q_gate[:, 1].reshape(Hq * D, H),
        t.take(p + "k_proj.weight", (Hkv * D, H)),
        t.take(p + "v_proj.weight", (Hkv * D, H)),
    ]
    out = {
        "qkv_proj": np.concatenate(rows, axis=0).T,
        "o_proj": t.take(p + "o_proj.weight", (H, Hq * D)).T,
        "q_norm": t.take(p + "q_norm.weight", (D,)),
        "k_norm": t.take(p + "k_norm.weight", (D,)),
    }
    if cfg.attention_bias:
        qb = t.take(p + "q_proj.bias", (2 * Hq * D,)).reshape(Hq, 2, D)
        kb = t.take(p + "k_proj.bias", (Hkv * D,))
        vb = t.take(p + "v_proj.bias", (Hkv * D,))
        out["qkv_bias"] = np.concatenate([qb[:, 0].reshape(-1), qb[:, 1].reshape(-1), kb, vb])
        out["o_bias"] = t.take(p + "o_proj.bias", (H,))
    return out


def _dense_mlp(t: "_Tensors", p: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    gate = t.take(p + "gate_proj.weight", (I, H))
    up = t.take(p + "up_proj.weight", (I, H))
    return {"gate_up": np.concatenate([gate, up], axis=0).T, "down": t.take(p + "down_proj.weight", (H, I)).T}


def _moe(t: "_Tensors", p: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    if t.has(p + "experts.gate_up_proj"):
        # fused (Qwen3.5-MoE releases): gate_up [E, 2I, H] with gate rows first, down [E, H, I]
        gate_up = t.take(p + "experts.gate_up_proj", (E, 2 * I, H))
        down = t.take(p + "experts.down_proj", (E, H, I))
    else:
        e = p + "experts."
        gate_up = np.stack([
            np.concatenate([t.take(f"{e}{j}.gate_proj.weight", (I, H)), t.take(f"{e}{j}.up_proj.weight", (I, H))])
            for j in range(E)
        ])
        down = np.stack([t.take(f"{e}{j}.down_proj.weight", (H, I)) for j in range(E)])
    shared_gate = t.take(p + "shared_expert.gate_proj.weight", (Is, H))
    shared_up = t.take(p + "shared_expert.up_proj.weight", (Is, H))
    return {
        "router": t.take(p + "gate.weight", (E, H)).T,
        "experts_gate_up": gate_up.transpose(0, 2, 1),
        "experts_down": down.transpose(0, 2, 1),
        "shared_gate_up": np.concatenate([shared_gate, shared_up], axis=0).T,
        "shared_down": t.take(p + "shared_expert.down_proj.weight", (H, Is)).T,
        "shared_gate": t.take(p + "shared_expert_gate.weight", (1, H)).T,
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

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self._path}")
        handle, original, file = self._where[name]
        got = tuple(handle.get_slice(original).get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"tensor {original!r} in {file} has shape {got}; the config expects {tuple(shape)}")
        self._used.add(name)
        return handle.get_tensor(original)

    def check_all_used(self) -> None:
        unused = [n for n in self._where if n not in self._used]
        if unused:
            _, original, file = self._where[unused[0]]
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            raise CheckpointError(f"unexpected tensor {original!r} in {file}{more}; does the config match the checkpoint?")
