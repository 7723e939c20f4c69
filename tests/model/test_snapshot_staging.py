"""Narrow device snapshot rows (qnext/model/snapshot_staging.py) at the step: a separate float32 pool gives exactly
the single-buffer step (logits and snapshot contents: restores from the pool in decode and prefill, captures at a
segment's end, inside it through the staging rows, and at a decode step), and a bfloat16 pool holds exactly the
float32 snapshots rounded once."""
from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qnext
from cache.device_buffers import allocate_cache_buffers
from qnext.model.cache_layout import cache_layout
from qnext.model.step_inputs import LayoutSizes, Segment, build_step_inputs
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

BS, CHUNK, LIVE, SNAPSHOTS, STAGING = 16, 16, 2, 4, 2
SIZES = LayoutSizes(num_tokens=48, num_decode=2, num_chunks=4, max_blocks=4, num_logits=48)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return qnext.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("staging"), "qwen3_5"))


def buffers_and_ids(model, pool_dtype: str | None):
    """The buffers and the row ids of snapshots 0..SNAPSHOTS-1: one buffer (pool_dtype None), or a separate pool."""
    dtype = np.dtype(model.dtype).name
    if pool_dtype is None:
        layout = cache_layout(model.config, dtype)
        buffers = allocate_cache_buffers(layout, num_blocks=8, block_size=BS, num_state_rows=1 + LIVE + SNAPSHOTS)
        return buffers, [1 + LIVE + i for i in range(SNAPSHOTS)]
    layout = cache_layout(model.config, dtype, mamba_ssm_cache_dtype=pool_dtype)
    buffers = allocate_cache_buffers(layout, num_blocks=8, block_size=BS, num_state_rows=1 + LIVE + STAGING,
                                     num_pool_rows=SNAPSHOTS, num_staging_rows=STAGING)
    return buffers, [1 + LIVE + STAGING + i for i in range(SNAPSHOTS)]


def run_steps(model, pool_dtype):
    """Step 1: A prefills 40 tokens capturing after 16 and 32 (inside the segment) and 40 (its end). Step 2: B
    prefills from the snapshot after 16, C decodes from the snapshot after 40 and captures after 41 (a decode
    capture). -> (logits of both steps, each snapshot's (conv, recurrent) per layer)."""
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 48).tolist()
    buffers, snap = buffers_and_ids(model, pool_dtype)
    out = []
    steps = [[Segment(ids[:40], 0, [1, 2, 3], -1, 1, captures={16: snap[0], 32: snap[1], 40: snap[2]},
                      all_logits=True)],
             [Segment([ids[40]], 40, [1, 2, 3], snap[2], 1, captures={41: snap[3]}),
              Segment(ids[16:30], 16, [1, 4], snap[0], 2, all_logits=True)]]
    for segments in steps:
        inputs = build_step_inputs(segments, SIZES, block_size=BS, chunk=CHUNK)
        logits, buffers = model._step(model.params, buffers, inputs)
        out.append(np.asarray(logits))
    first = buffers.first_pool_row
    conv, recurrent = (buffers.conv, buffers.recurrent) if first is None else \
        (buffers.snapshot_conv, buffers.snapshot_recurrent)
    offset = 0 if first is None else first
    states = [[(np.asarray(c[s - offset]), np.asarray(r[s - offset])) for c, r in zip(conv, recurrent)] for s in snap]
    return out, states


def test_a_float32_pool_is_exactly_the_single_buffer_step(model):
    want_logits, want_states = run_steps(model, None)
    got_logits, got_states = run_steps(model, "float32")
    for want, got in zip(want_logits, got_logits):
        np.testing.assert_array_equal(got, want)
    for want, got in zip(want_states, got_states):
        for (wc, wr), (gc, gr) in zip(want, got):
            np.testing.assert_array_equal(gc, wc)
            np.testing.assert_array_equal(gr, wr)
            assert np.abs(wr).max() > 0                       # every snapshot was written


def test_a_bfloat16_pool_holds_the_float32_snapshots_rounded_once(model):
    want_logits, want_states = run_steps(model, None)
    got_logits, got_states = run_steps(model, "bfloat16")
    np.testing.assert_array_equal(got_logits[0], want_logits[0])          # step 1 reads no snapshot
    for want, got in zip(want_states[:3], got_states[:3]):                # written by step 1 from the same states
        for (wc, wr), (gc, gr) in zip(want, got):
            np.testing.assert_array_equal(gc, wc)                         # conv: the model dtype, as before
            assert gr.dtype == jnp.bfloat16
            np.testing.assert_array_equal(gr, wr.astype(ml_dtypes.bfloat16))
    # step 2 started from rounded states: close, not equal (the live state is float32 again from there)
    np.testing.assert_allclose(got_logits[1][:15], want_logits[1][:15], atol=2e-2)
    assert not np.array_equal(got_logits[1][:15], want_logits[1][:15])
