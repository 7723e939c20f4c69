"""The engine's weights on its devices: the one way params are placed there and overwritten in place.

Placed params are the pytree of weights.param_specs(cfg), each leaf cast to the model dtype (A_log and dt_bias
stay float32) and committed to the engine's first device (as jitted outputs are, so that the step's compilations
serve both the first weights and every update's), or, under tensor parallelism, sharded over the engine's mesh
through host memory (tensor_parallel.shard_params). checkpoint.py places a checkpoint's weights the same way.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnext.config import ModelConfig
from qnext.ops.fp8_weight import Fp8Weight
from qnext.model.host_devices import engine_devices
from qnext.model.tensor_parallel import make_mesh, shard_params
from qnext.model.weights import ParamSpec, as_dtype, map_specs, param_specs


def place_params(params, cfg: ModelConfig, dtype: Any, tensor_parallel_size: int = 1):
    """In-memory params (the pytree of weights.param_specs(cfg) of the global cfg; jax or numpy arrays of any float
    dtype) -> the engine's own device arrays, always copies (the source's buffers stay the caller's)."""
    specs = param_specs(cfg, as_dtype(dtype))
    if tensor_parallel_size > 1:
        host = map_specs(lambda path, spec: _on_host(_checked(params, path, spec), spec), specs)
        return shard_params(host, cfg, make_mesh(tensor_parallel_size))
    device = engine_devices()[0]
    return map_specs(lambda path, spec: jax.device_put(_as_placed(_checked(params, path, spec), spec), device),
                     specs)


def _on_host(leaf, spec: ParamSpec):
    """A leaf as numpy in the spec's dtype; a kept fp8 weight (fp8_weight.py) stays e4m3 with its scales."""
    if isinstance(leaf, Fp8Weight):
        return jax.device_get(leaf)
    return np.asarray(jax.device_get(leaf)).astype(spec.dtype, copy=False)


def _as_placed(leaf, spec: ParamSpec):
    return jax.tree.map(jnp.array, leaf) if isinstance(leaf, Fp8Weight) else jnp.array(leaf, dtype=spec.dtype)


def place_mtp_params(mtp, dtype: Any):
    """The MTP head's params (model/mtp.py) cast to `dtype` on the default device (the head drafts on one device)."""
    return jax.tree.map(lambda x: jnp.asarray(x, as_dtype(dtype)), mtp)


def _checked(params, path: tuple, spec: ParamSpec):
    name = "/".join(map(str, path))
    try:
        leaf = params
        for key in path:
            leaf = leaf[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"the params have no weight {name}; pass the pytree of weights.param_specs(config) "
                         "(qnext.flax.engine_params(model)[1] for a Flax model)") from None
    if tuple(leaf.shape) != spec.shape:
        raise ValueError(f"weight {name} has shape {tuple(leaf.shape)}; the model's config needs {spec.shape}")
    return leaf


class WeightUpdate:
    """Overwrites placed weights in place with new params of the same structure and shapes (any float dtype):
    under tensor parallelism the new params are placed first (place_params: sharded through host memory), then one
    compiled copy writes them into the old buffers (donated, so one set of weights is alive), cast to their dtypes.
    The copy is compiled per signature (shapes, dtypes, shardings) of the new params; `prepare` compiles it ahead,
    so that an update of the prepared signature compiles nothing."""

    def __init__(self, cfg: ModelConfig, dtype: Any, tensor_parallel_size: int = 1):
        self.cfg, self.dtype, self.tensor_parallel_size = cfg, as_dtype(dtype), tensor_parallel_size
        self._copy = self._signature = None

    def prepare(self, placed, example=None) -> None:
        """Compiles the copy into `placed` for updates shaped like `example` (default: `placed` itself)."""
        example = placed if example is None else example
        copy = jax.jit(lambda old, new: jax.tree.map(_overwrite, old, new), donate_argnums=0)
        self._copy = copy.lower(_shapes(placed), _shapes(example)).compile()
        self._signature = _signature(example)

    def __call__(self, placed, params):
        """The new weights, in `placed`'s buffers (donated: `placed` is consumed)."""
        if _has_fp8(placed) and not _has_fp8(params):
            raise ValueError("this engine holds an FP8 checkpoint's weights in e4m3 (fp8_weights='keep'); "
                             "update_weights takes plain weights only into an engine started with "
                             "fp8_weights='dequantize'")
        if self.tensor_parallel_size > 1:
            params = place_params(params, self.cfg, self.dtype, self.tensor_parallel_size)
        if jax.tree.map(lambda x: x.shape, placed) != jax.tree.map(lambda x: x.shape, params):
            raise ValueError("update_weights needs params of the engine's structure and shapes (weights.param_specs), "
                             f"got {jax.tree.structure(params)}")
        if _signature(params) != self._signature:
            self.prepare(placed, params)
        return self._copy(placed, params)


def _has_fp8(params) -> bool:
    return any(isinstance(x, Fp8Weight) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight)))


def _overwrite(old, new):
    # written into `old` (donated): a plain `new.astype(old.dtype)` leaves `old` unused, so XLA would drop the
    # donation and return a fresh buffer, two copies of the weights alive at once
    return jax.lax.dynamic_update_slice(old, new.astype(old.dtype), (0,) * old.ndim)


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _signature(params):
    """What a compiled copy is built for: each leaf's shape, dtype and sharding."""
    return jax.tree.map(lambda x: (x.shape, str(x.dtype), getattr(x, "sharding", None)), params)
