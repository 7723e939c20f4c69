"""An FP8 weight kept as released: e4m3 values with float32 block scales (fp8_blocks.py: W = Q * S per block), a
pytree node that the model's `linear()` and the MoE grouped matmul multiply directly (engine option
`fp8_weights="keep"`). Device memory holds the fp8 bytes plus one float32 per block.

Layout: the model's, with the scales following it. A dense weight is [out, in] with scale_inv [ceil(out/b0),
ceil(in/b1)] as released; an expert stack (released [E, out, in]) is transposed at load to the grouped matmul's
[E, in, out], its scales to [E, ceil(in/b1), ceil(out/b0)] and block_size to (b1, b0). So `block_size` is always
(rows, columns) of the last two dims as stored, and tensor parallelism shards q and scale_inv along the same axis
with the same PartitionSpec (fp8_sharding.py). `block_size` is static (part of the tree structure).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    q: jax.Array                      # [..., rows, cols] float8_e4m3fn
    scale_inv: jax.Array              # [..., ceil(rows/b0), ceil(cols/b1)] float32
    block_size: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    tail: jax.Array | None = None     # [t, cols] rows left in bf16 by the release, after the fp8 rows (in_proj's b a)

    @property
    def shape(self) -> tuple[int, ...]:
        rows, cols = self.q.shape[-2:]
        extra = 0 if self.tail is None else self.tail.shape[-2]
        return (*self.q.shape[:-2], rows + extra, cols)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes) + int(self.scale_inv.nbytes) + (0 if self.tail is None else int(self.tail.nbytes))

    def dequantized(self, dtype):
        """W in `dtype` (products in float32, rounded once), the tail rows appended."""
        w = dequantize_on_device(self.q, self.scale_inv, self.block_size, dtype)
        return w if self.tail is None else jnp.concatenate([w, self.tail.astype(dtype)], axis=-2)


def dequantize_on_device(q, scale_inv, block_size: tuple[int, int], dtype):
    """q [..., out, in] e4m3, scale_inv [..., ceil(out/b0), ceil(in/b1)] float32 -> W [..., out, in] in `dtype`
    (the product is taken in float32, then rounded once to `dtype`: the loader's dequantisation exactly)."""
    rows, cols = q.shape[-2:]
    b0, b1 = block_size
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), b0, axis=-2), b1, axis=-1)[..., :rows, :cols]
    return (q.astype(jnp.float32) * s).astype(dtype)
