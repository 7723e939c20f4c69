"""The weights pytree (docs/CONTRACTS.md): shapes, dtypes and logical axes declared once.

Dense matmul weights are [out, in], the checkpoint's nn.Linear layout (x @ W^T, see qnext/ops/linear.py);
expert stacks are [E, in, out] (the grouped matmul's layout). Axis names are logical ("vocab", "embed", "heads",
"mlp", "expert"); tensor parallelism splits the "heads", "mlp" and "vocab" axes (tensor_parallel.py); None means
the axis is never split (the embedding table is replicated: a lookup by token id). A fused param declares the
sizes of its segments along its split axis (qkv_proj: q | gate | k | v), so that each device takes every segment's
part. `A_log` and `dt_bias` are float32 whatever the model dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from qnext.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: Any  # numpy dtype (float32 or ml_dtypes.bfloat16)
    axes: tuple[str | None, ...]
    segments: tuple[int, ...] | None = None   # fused: segment sizes along the split axis, in order
    after_reduce: bool = False   # a bias added to a row-parallel projection's output (each device adds a share)


def as_dtype(dtype: Any) -> np.dtype:
    """'float32' / 'bfloat16' / numpy or jax dtype -> numpy dtype (bfloat16 via ml_dtypes)."""
    if isinstance(dtype, str) and dtype in ("bf16", "bfloat16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if isinstance(dtype, str) and dtype in ("fp32", "f32"):
        return np.dtype(np.float32)
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32 or bfloat16") from None
    if d.name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {d.name!r} is not supported; use float32 or bfloat16")
    return d


def param_specs(cfg: ModelConfig, dtype: Any = "float32") -> dict[str, Any]:
    dt = as_dtype(dtype)
    f32 = np.dtype(np.float32)
    H, V = cfg.hidden_size, cfg.vocab_size

    def spec(shape: tuple[int, ...], axes: tuple[str | None, ...], dtype_: np.dtype = dt, **kw) -> ParamSpec:
        return ParamSpec(tuple(shape), dtype_, axes, **kw)

    layers = []
    for i in range(cfg.num_hidden_layers):
        layer = {"input_norm": spec((H,), ("embed",)), "post_attn_norm": spec((H,), ("embed",))}
        if cfg.is_linear_layer(i):
            Hv, qk, v = cfg.linear_num_value_heads, cfg.key_dim, cfg.value_dim
            layer["attn"] = {
                # rows: q (Hk*dk) | k (Hk*dk) | v (Hv*dv) | z (Hv*dv) | b (Hv) | a (Hv)
                "in_proj": spec((cfg.conv_dim + cfg.value_dim + 2 * Hv, H), ("heads", "embed"),
                                segments=(qk, qk, v, v, Hv, Hv)),
                "conv_weight": spec((cfg.conv_dim, cfg.linear_conv_kernel_dim), ("heads", None),
                                    segments=(qk, qk, v)),
                "A_log": spec((Hv,), ("heads",), f32),
                "dt_bias": spec((Hv,), ("heads",), f32),
                "norm": spec((cfg.linear_value_head_dim,), (None,)),
                "out_proj": spec((H, cfg.value_dim), ("embed", "heads")),
            }
        else:
            Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            qkv = 2 * Hq * D + 2 * Hkv * D  # q | gate | k | v
            fused = (Hq * D, Hq * D, Hkv * D, Hkv * D)
            attn = {
                "qkv_proj": spec((qkv, H), ("heads", "embed"), segments=fused),
                "o_proj": spec((H, Hq * D), ("embed", "heads")),
                "q_norm": spec((D,), (None,)),
                "k_norm": spec((D,), (None,)),
            }
            if cfg.attention_bias:
                attn["qkv_bias"] = spec((qkv,), ("heads",), segments=fused)
                attn["o_bias"] = spec((H,), ("embed",), after_reduce=True)
            layer["attn"] = attn
        if cfg.is_moe_layer(i):
            E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            layer["mlp"] = {
                "router": spec((E, H), (None, "embed")),
                "experts_gate_up": spec((E, H, 2 * I), ("expert", "embed", "mlp"), segments=(I, I)),
                "experts_down": spec((E, I, H), ("expert", "mlp", "embed")),
                "shared_gate_up": spec((2 * Is, H), ("mlp", "embed"), segments=(Is, Is)),
                "shared_down": spec((H, Is), ("embed", "mlp")),
                "shared_gate": spec((1, H), (None, "embed")),
            }
        else:
            I = cfg.intermediate_size
            layer["mlp"] = {"gate_up": spec((2 * I, H), ("mlp", "embed"), segments=(I, I)),
                            "down": spec((H, I), ("embed", "mlp"))}
        layers.append(layer)

    return {
        "embed": spec((V, H), (None, "embed")),
        "final_norm": spec((H,), ("embed",)),
        "lm_head": spec((V, H), ("vocab", "embed")),
        "layers": tuple(layers),
    }


def map_specs(fn, specs: Any, path: tuple = ()) -> Any:
    """Applies fn(path, spec) to every ParamSpec leaf; path is a tuple of dict keys / tuple indices."""
    if isinstance(specs, ParamSpec):
        return fn(path, specs)
    if isinstance(specs, dict):
        return {k: map_specs(fn, v, path + (k,)) for k, v in specs.items()}
    if isinstance(specs, tuple):
        return tuple(map_specs(fn, v, path + (i,)) for i, v in enumerate(specs))
    raise TypeError(f"unexpected node {type(specs).__name__} in the weights pytree")


def init_params(cfg: ModelConfig, dtype: Any = "float32", seed: int = 0) -> dict[str, Any]:
    """Random numpy params in the contract layout, every parameter perturbed (norms too), for quick tests."""
    rng = np.random.default_rng(seed)

    def init(path: tuple, s: ParamSpec) -> np.ndarray:
        name = path[-1]
        if name == "A_log":
            x = np.log(rng.uniform(1.0, 16.0, s.shape))
        elif name == "dt_bias":
            x = 1.0 + 0.3 * rng.standard_normal(s.shape)
        elif name == "norm":  # gated RMSNorm: plain w around 1
            x = 1.0 + 0.2 * rng.standard_normal(s.shape)
        elif len(s.shape) == 1:  # zero-centred norms and biases
            x = 0.2 * rng.standard_normal(s.shape)
        elif name == "conv_weight":
            x = 0.3 * rng.standard_normal(s.shape)
        else:
            x = 0.06 * rng.standard_normal(s.shape)
        return x.astype(s.dtype)

    params = map_specs(init, param_specs(cfg, dtype))
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"].copy()
    return params
