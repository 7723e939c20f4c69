"""Every Mosaic GPU kernel equals its jnp reference in the Mosaic GPU interpreter (CPU), race detector on.

The interpreter simulates GMEM, SMEM, TMA copies and barriers per CUDA block and warpgroup, with a happens-before
race detector (pallas_kernels/mosaic_common.py; wgmma is emulated by a dot there). The ops go through the public
dispatch with implementation="mosaic", interpret=True; the references with implementation="reference".
Interpreted kernels are slow (seconds each): few, small cases that still cover ragged rows, padding rows,
snapshot captures, partial pages, several pages per loop step, several row blocks, and chunk tails.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as ops
from pallas_kernels import mosaic_common as mc
from tests.support.kernel_cases import (ATTN_CASES, attn_inputs, decode_row_layout, gdr_inputs,
                                       random_attn_layout, random_row_layout)

MAX_ERRORS: dict[str, float] = {}     # printed at the end of the module (pytest -s): the report's numbers


@pytest.fixture(scope="module", autouse=True)
def _print_max_errors():
    yield
    for name, err in sorted(MAX_ERRORS.items()):
        print(f"\nmax |mosaic - reference| {name}: {err:.3g}")


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raised leaves the interpreter's simulated GPU state behind; no test inherits it."""
    yield
    mc.reset_interpreter()


def _both(op, *args, **kwargs):
    """(Mosaic GPU kernel in the interpreter, reference) results of one public op as numpy pytrees; the kernel
    must run race-free."""
    got = op(*args, implementation="mosaic", interpret=True, **kwargs)
    jax.block_until_ready(got)
    assert not mc.races_found(), "the Mosaic GPU interpreter detected a race"
    want = jax.jit(functools.partial(op, implementation="reference", **kwargs))(*args)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), (got, want))


def _record(name, got, want):
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    MAX_ERRORS[name] = max(MAX_ERRORS.get(name, 0.0), err)


# ------------------------------------------------------------------------------------------------ gated delta rule
@pytest.mark.parametrize("seed, hk, hv, dk, dv, dtype", [
    (0, 1, 2, 64, 32, np.float32),            # GQA 2, dv = one 32-column tile row
    (1, 2, 4, 64, 64, jnp.bfloat16),          # bf16 q/k/v
])
def test_recurrent_gated_delta_rule_mosaic(seed, hk, hv, dk, dv, dtype):
    rng = np.random.default_rng(seed)
    layout = decode_row_layout(rng, 4, num_pad=1)            # reads live rows, snapshots and zeros; captures
    q, k, v, g, beta, pool = gdr_inputs(rng, 4, hk, hv, dk, dv, layout.num_rows, dtype)
    rows = [jnp.asarray(x[:, 0]) for x in (layout.to_groups(y, rng) for y in (q, k, v, g, beta))]
    _, read_row, write_row, capture_row, _, _ = layout.rows()
    (o, new_pool), (o_ref, pool_ref) = _both(ops.recurrent_gated_delta_rule, *rows, jnp.asarray(pool), read_row,
                                             write_row, capture_row)
    live = np.asarray(write_row) > 0             # padding rows' outputs are unused (the reference may zero them)
    o, o_ref = o[live], o_ref[live]
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_pool[1:], pool_ref[1:], rtol=1e-5, atol=1e-5)
    _record("recurrent_gated_delta_rule o", o, o_ref)
    _record("recurrent_gated_delta_rule state", new_pool[1:], pool_ref[1:])


@pytest.mark.parametrize("seed, seg_lens, hk, hv, dk, dv, dtype", [
    (0, (70, 1, 20), 1, 2, 64, 64, np.float32),      # a 2-group segment with a 6-row tail, a 1-token segment
    (3, (24, 9), 1, 2, 64, 128, jnp.bfloat16),       # bf16, 2 V-blocks of 64, captures mid-segment
])
def test_chunk_gated_delta_rule_mosaic(seed, seg_lens, hk, hv, dk, dv, dtype):
    rng = np.random.default_rng(seed)
    layout = random_row_layout(rng, seg_lens, 64, num_pad=1)
    q, k, v, g, beta, pool = gdr_inputs(rng, layout.num_tokens, hk, hv, dk, dv, layout.num_rows, dtype)
    groups = [jnp.asarray(layout.to_groups(x, rng)) for x in (q, k, v, g, beta)]
    length, read_row, write_row, capture_row, is_first, is_last = layout.rows()
    (o, new_pool), (o_ref, pool_ref) = _both(ops.chunk_gated_delta_rule, *groups, length, jnp.asarray(pool),
                                             read_row, write_row, capture_row, is_first, is_last)
    # The state pass multiplies bfloat16 operands on the tensor cores (float32 accumulation, as FLA's kernels).
    np.testing.assert_allclose(o, o_ref, rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(new_pool[1:], pool_ref[1:], rtol=2e-2, atol=1e-2)
    _record("chunk_gated_delta_rule o", o, o_ref)
    _record("chunk_gated_delta_rule state", new_pool[1:], pool_ref[1:])


# ----------------------------------------------------------------------------------------------------- conv1d
@pytest.mark.parametrize("d, dtype", [(384, np.float32), (256, jnp.bfloat16)])   # 3 channel blocks; bf16 state
def test_causal_conv1d_update_mosaic(d, dtype):
    rng = np.random.default_rng(5)
    layout = decode_row_layout(rng, 4, num_pad=1)
    x = jnp.asarray(layout.to_groups(rng.normal(size=(4, d)).astype(np.float32), rng)[:, 0], dtype)
    weight = jnp.asarray(rng.normal(size=(d, 4)), dtype)
    pool = jnp.asarray(rng.normal(size=(layout.num_rows, 3, d)), dtype).at[0].set(0)
    _, read_row, write_row, capture_row, _, _ = layout.rows()
    (y, new_pool), (y_ref, pool_ref) = _both(ops.causal_conv1d_update, x, weight, pool, read_row, write_row,
                                             capture_row)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(y, y_ref, **tol)
    np.testing.assert_allclose(new_pool[1:], pool_ref[1:], rtol=0, atol=0)
    _record(f"causal_conv1d_update y ({jnp.dtype(dtype).name})", y, y_ref)


# ------------------------------------------------------------------------------------------------ paged attention
LONG = {"long decode": (((150, 1), (0, 1), (70, 1)), 1),       # 10-page tables: 3 key steps -> 3 KV splits
        "long prefill": (((100, 40), (0, 20)), 16)}             # splits past a causal group's end stay empty


@pytest.mark.parametrize("case, hq, hkv, d, block_size", [
    ("decode", 4, 2, 64, 16),       # 4 pages per 64-key step, partial last pages, a padding row
    ("prefill", 8, 2, 64, 16),      # causal groups of 16 queries x 4 heads = one 64-row block
    ("mixed", 12, 1, 64, 32),       # 192 rows = 3 row blocks (one all padding), 2 pages per step
    ("decode", 2, 2, 128, 64),      # one page per step, D = 128
    ("long decode", 6, 2, 64, 16),  # GQA 3 (not a power of two)
    ("long prefill", 4, 2, 64, 16),
])
def test_paged_attention_mosaic(case, hq, hkv, d, block_size):
    seqs, group_len = LONG[case] if case in LONG else ATTN_CASES[case]
    rng = np.random.default_rng(hq + d)
    layout = random_attn_layout(rng, seqs, group_len, block_size, num_pad=1)
    q, k_pages, v_pages = (jnp.asarray(x, jnp.bfloat16) for x in attn_inputs(rng, layout, hq, hkv, d, block_size))
    got, want = _both(ops.paged_attention, q, k_pages, v_pages, jnp.asarray(layout.block_table),
                      jnp.asarray(layout.kv_len), jnp.asarray(layout.q_pos), sm_scale=d ** -0.5)
    # P is rounded to bfloat16 for the P V product on the tensor cores (the reference keeps it in float32).
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    _record("paged_attention", got, want)


def test_paged_attention_mosaic_double_buffer_over_many_steps():
    """No KV splits: one loop over 3 and 2 key steps, so both SMEM slots are filled, read and refilled."""
    from pallas_kernels import paged_attention_mosaic

    rng = np.random.default_rng(7)
    layout = random_attn_layout(rng, ((150, 1), (100, 1)), 1, 16, num_pad=0)
    q, k_pages, v_pages = (jnp.asarray(x, jnp.bfloat16) for x in attn_inputs(rng, layout, 2, 1, 64, 16))
    args = (q, k_pages, v_pages, jnp.asarray(layout.block_table), jnp.asarray(layout.kv_len),
            jnp.asarray(layout.q_pos))
    got = paged_attention_mosaic.paged_attention(*args, sm_scale=0.125, interpret=True, min_blocks=1)
    jax.block_until_ready(got)
    assert not mc.races_found(), "the Mosaic GPU interpreter detected a race"
    want = ops.paged_attention(*args, sm_scale=0.125, implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
    _record("paged_attention", np.asarray(got), np.asarray(want))


# ------------------------------------------------------------------------------------------------ dispatch, races
def test_mosaic_falls_back_to_the_reference_for_shapes_it_does_not_take(caplog):
    """float32 pages (tf32 wgmma cannot take V's layout): the reference runs, with a warning; under the
    interpreter the same call raises."""
    rng = np.random.default_rng(0)
    layout = random_attn_layout(rng, ATTN_CASES["decode"][0], 1, 16, num_pad=1)
    q, k_pages, v_pages = (jnp.asarray(x) for x in attn_inputs(rng, layout, 4, 2, 64, 16))
    args = (q, k_pages, v_pages, jnp.asarray(layout.block_table), jnp.asarray(layout.kv_len),
            jnp.asarray(layout.q_pos))
    with caplog.at_level("WARNING"):
        got = ops.paged_attention(*args, sm_scale=0.125, implementation="mosaic")
    want = ops.paged_attention(*args, sm_scale=0.125, implementation="reference")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "no Mosaic GPU kernel" in caplog.text
    with pytest.raises(ValueError, match="pages must be bfloat16 or float16"):
        ops.paged_attention(*args, sm_scale=0.125, implementation="mosaic", interpret=True)
    with pytest.raises(ValueError, match="dk must be a multiple of 64"):
        rows = jnp.zeros((1,), jnp.int32)
        ops.recurrent_gated_delta_rule(jnp.zeros((1, 1, 32)), jnp.zeros((1, 1, 32)), jnp.zeros((1, 1, 32)),
                                       jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros((2, 1, 32, 32)),
                                       rows, rows, rows, implementation="mosaic", interpret=True)


def test_race_detector_sees_an_unsynchronised_smem_read():
    """The check the kernel tests rely on can fail: reading SMEM that a TMA copy is writing, before waiting on
    its barrier, is reported as a race."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, o_ref, x_smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, x_smem, bar)
        early = x_smem[...]                                    # no barrier_wait before the read: a race
        plgpu.barrier_wait(bar)
        x_smem[...] = early + 1.0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    x = jnp.arange(128, dtype=jnp.float32)
    mc.launch(body, (x,), (jax.ShapeDtypeStruct((128,), jnp.float32),), grid=(1,), grid_names=("b",),
              scratch=(plgpu.SMEM((128,), jnp.float32), plgpu.Barrier(num_arrivals=1)), interpret=True,
              name="racy")[1][0].block_until_ready()
    assert mc.races_found()
