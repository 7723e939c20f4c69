"""Mosaic GPU (Hopper+) causal conv1d + SiLU, single-step (decode) form; math as in causal_conv1d.py.

Update kernel (`causal_conv1d_update`), grid (N, D / BD), BD = 256 or 128 channels, one warpgroup each:
- TMA copies the K-1 halo rows of read_row [K-1, BD] (row 0 is the zero state; -1 reads it too), x [BD] and the
  weights [K, BD] (transposed to [K, D] float32 outside: a [BD, K] box would have a K-element minor dimension,
  under TMA's 16-byte minimum for bf16) into SMEM.
- window = [halo (rounded to x's dtype, as the reference does) | x]; y = silu(sum_j w_j window_j) in float32,
  vectors in the strided register layout.
- The new state (the last K-1 entries of the window) goes through SMEM to write_row and capture_row (rows 0: no
  write) with TMA stores.
The chunked (prefill) form has no Mosaic GPU kernel: under this backend it runs the jnp reference (XLA).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc

F32 = jnp.float32


def _block_d(d):
    for block in (256, 128):           # a TMA box is at most 256 elements along a dimension
        if d % block == 0:
            return block
    raise ValueError(f"causal_conv1d_update Mosaic GPU kernel: the channel count must be a multiple of 128, got {d}")


def _update_body(rows_ref, x_ref, w_ref, state_ref, y_ref, halo_smem, x_smem, w_smem, new_smem, y_smem, bar, *,
                 block_d, width):
    n, cb = jax.lax.axis_index("n"), jax.lax.axis_index("c")
    cols = pl.ds(cb * block_d, block_d)
    read, write, capture = rows_ref[0, n], rows_ref[1, n], rows_ref[2, n]
    plgpu.copy_gmem_to_smem(state_ref.at[jnp.maximum(read, 0), :, cols], halo_smem, bar)
    plgpu.copy_gmem_to_smem(x_ref.at[n, cols], x_smem, bar)
    plgpu.copy_gmem_to_smem(w_ref.at[:, cols], w_smem, bar)
    plgpu.barrier_wait(bar)
    x = x_smem[...]
    window = [halo_smem[j].astype(x.dtype) for j in range(width - 1)] + [x]
    acc = w_smem[width - 1] * x.astype(F32)
    for j in range(width - 1):
        acc = acc + w_smem[j] * window[j].astype(F32)
    y_smem[...] = (acc / (1.0 + jnp.exp(-acc))).astype(y_smem.dtype)
    for j in range(width - 1):
        new_smem[j] = window[j + 1].astype(new_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(y_smem, y_ref.at[n, cols])
    for row in (write, capture):
        @pl.when(row > 0)
        def _():
            plgpu.copy_smem_to_gmem(new_smem, state_ref.at[row, :, cols])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def causal_conv1d_update(x, weight, conv_state, read_row, write_row, capture_row, *, interpret=False):
    """x: [N, D]; weight: [D, K]; conv_state: [R, K-1, D]; rows: [N]. Returns (y [N, D] x.dtype, conv_state)."""
    n, d = x.shape
    width = weight.shape[1]
    block_d = _block_d(d)
    rows = jnp.stack([read_row, write_row, capture_row]).astype(jnp.int32)
    operands = (rows, x, weight.astype(F32).T, conv_state)
    body = functools.partial(_update_body, block_d=block_d, width=width)
    scratch = (plgpu.SMEM((width - 1, block_d), conv_state.dtype), plgpu.SMEM((block_d,), x.dtype),
               plgpu.SMEM((width, block_d), F32), plgpu.SMEM((width - 1, block_d), conv_state.dtype),
               plgpu.SMEM((block_d,), x.dtype), plgpu.Barrier(num_arrivals=3))
    ins, (y,) = mc.launch(body, operands, (jax.ShapeDtypeStruct((n, d), x.dtype),), grid=(n, d // block_d),
                          grid_names=("n", "c"), scratch=scratch, interpret=interpret, name="causal_conv1d_update_mosaic")
    return y, ins[-1]
