"""Shared plumbing of the Mosaic GPU (Pallas `plgpu`, Hopper sm_90a and newer) kernels.

- `launch` runs a kernel body over a `plgpu.Mesh` grid (one CUDA block of one warpgroup per grid point) with the
  operands as GMEM refs. It goes through `pl.run_state` + `pl.core_map`, so every operand the body writes (the
  state pools, the outputs) is aliased in and out of the kernel: a pool is updated in place, never copied whole.
- Interpretation: `interpret=True` runs the kernel in the Mosaic GPU interpreter of jax (CPU: simulated GMEM and
  SMEM, TMA copies, barriers and wgmma, with the race detector on). Register-layout hints (`layout_cast`, iota with
  a layout) have no meaning there and are skipped (`Layouts`).
- SMEM operands of `wgmma` and 2-D register tiles are tiled and swizzled (128-byte swizzle): a [rows, cols] f32
  tile needs rows % 8 == 0 and cols % 32 == 0, bf16 cols % 64 == 0; the TMA copies apply the transform.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE = 128


def interpret_params():
    """The Mosaic GPU interpreter's parameters (private in jax 0.10 and 0.11): races detected, NaN-filled SMEM."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(detect_races=True, uninitialized_memory="nan")


def races_found() -> bool:
    """Whether the interpreter's race detector saw a race in the kernels interpreted since the last reset."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    races = gpu_callbacks._races
    return bool(races is not None and races.races_found)


def reset_interpreter():
    """Drop the interpreter's simulated memory and race state (needed after a kernel raised while interpreted)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    gpu_callbacks.reset_gpu_interpret_mode_state()


def tiled(dtype):
    """Tiling + swizzle transforms of a 2-D SMEM tile of `dtype` (row-major, 128-byte swizzle)."""
    return (plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(SWIZZLE))


def smem_tile(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=tiled(dtype))


class Layouts:
    """Register-layout hints of a kernel body; identity under the interpreter (which has no layouts)."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def cast(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def rows(self, x):
        """A vector along the rows (axis 0) of a WGMMA-layout [M, N] tile."""
        return self.cast(x, plgpu.Layout.WGMMA.reduce(1))

    def cols(self, x):
        """A vector along the columns (axis 1) of a WGMMA-layout [M, N] tile."""
        return self.cast(x, plgpu.Layout.WGMMA.reduce(0))

    def tile(self, x):
        return self.cast(x, plgpu.Layout.WGMMA)

    def iota(self, shape, axis):
        if self.interpret:
            return jax.lax.broadcasted_iota(jnp.int32, shape, axis)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def matmul(a, b_ref, *, lay, transpose_a=False, transpose_b=False):
    """a [M, K] (an SMEM ref or a register value in the WGMMA layout; transpose_a: an SMEM ref holding a^T [K, M])
    @ b [K, N] (an SMEM ref; transpose_b: the ref holds b^T [N, K]) on the tensor cores (wgmma), float32
    accumulation; returns the [M, N] float32 value. Transposed operands: 16-bit dtypes only (wgmma's rule).

    Under the interpreter the product is a float32-accumulating dot of the same operands: its wgmma takes neither a
    register operand nor a transposed SMEM view, so only the instruction itself is emulated; the copies, barriers
    and SMEM accesses around it are still simulated and race-checked."""
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b_ref.shape[0] if transpose_b else b_ref.shape[1]
    if lay.interpret:
        a_val = a[...] if hasattr(a, "at") else a
        dims = (((0,) if transpose_a else (1,), (1,) if transpose_b else (0,)), ((), ()))
        return jax.lax.dot_general(a_val, b_ref[...], dims, preferred_element_type=jnp.float32)
    a = plgpu.transpose_ref(a, (1, 0)) if transpose_a else a
    b = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC((m, n), jnp.float32))


def bcast_rows(vec, shape):
    """[M] -> [M, N] (the value of row i everywhere in row i)."""
    return jax.lax.broadcast_in_dim(vec, shape, (0,))


def bcast_cols(vec, shape):
    """[N] -> [M, N]."""
    return jax.lax.broadcast_in_dim(vec, shape, (1,))


def launch(body, operands, outputs, *, grid, grid_names, scratch, interpret, name):
    """Run `body(*operand_refs, *output_refs, *scratch_refs)` on a Mosaic GPU grid.

    operands: arrays; those the body writes are aliased (updated in place). outputs: ShapeDtypeStructs of fresh
    outputs (zero-initialised by XLA, then written by the body). Returns (operands after the kernel, outputs).
    """
    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, kernel_name=name)
    n_in = len(operands)

    def stateful(refs):
        @pl.core_map(mesh, interpret=interpret_params() if interpret else False)
        def _():
            pl.run_scoped(lambda *scratch_refs: body(*refs, *scratch_refs), *scratch)

    init = tuple(operands) + tuple(jnp.zeros(o.shape, o.dtype) for o in outputs)
    result = pl.run_state(stateful)(init)
    return result[:n_in], result[n_in:]
