"""ParamGroup: a flat dict of params as one nnx.Module (the text model's mixers and MLPs, the tower's parts)."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx


class ParamGroup(nnx.Module):
    """A flat dict of the engine's params (one mixer or MLP) as nnx.Param attributes of the same names."""

    def __init__(self, params: dict[str, Any]):
        for name, value in params.items():
            setattr(self, name, nnx.Param(jnp.asarray(value)))
