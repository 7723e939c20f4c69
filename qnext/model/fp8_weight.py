"""An FP8 weight kept as released: e4m3 values with float32 block scales (fp8_blocks.py: W = Q * S per block), a
pytree node that the model's `linear()` and the MoE grouped matmul multiply directly (engine option
`fp8_weights="keep"`). Device memory holds the fp8 bytes plus one float32 per block.

Layouts: a dense weight is [out, in] with scale_inv [ceil(out/b0), ceil(in/b1)], as everywhere in the model; an
expert stack is kept in the checkpoint's [E, out, in] (blocks run over out and in, so the model's [E, in, out]
layout would cut them) and `expert_stack=True` says so. `block_size` is static (part of the tree structure).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    q: jax.Array                      # [..., out, in] float8_e4m3fn
    scale_inv: jax.Array              # [..., ceil(out/b0), ceil(in/b1)] float32
    block_size: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    expert_stack: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight in the model's layout ([E, in, out] for an expert stack)."""
        shape = tuple(self.q.shape)
        return (*shape[:-2], shape[-1], shape[-2]) if self.expert_stack else shape

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes) + int(self.scale_inv.nbytes)

    def dequantized(self, dtype):
        """W in the model's layout and `dtype` (products in float32, rounded once)."""
        w = dequantize_on_device(self.q, self.scale_inv, self.block_size, dtype)
        return jnp.swapaxes(w, -1, -2) if self.expert_stack else w


def dequantize_on_device(q, scale_inv, block_size: tuple[int, int], dtype):
    """q [..., out, in] e4m3, scale_inv [..., ceil(out/b0), ceil(in/b1)] float32 -> W [..., out, in] in `dtype`
    (the product is taken in float32, then rounded once to `dtype`: the loader's dequantisation exactly)."""
    rows, cols = q.shape[-2:]
    b0, b1 = block_size
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), b0, axis=-2), b1, axis=-1)[..., :rows, :cols]
    return (q.astype(jnp.float32) * s).astype(dtype)
