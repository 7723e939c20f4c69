"""Batch-1 decode at the memory's rate: a one-row decode step (its projections are matrix-vector products) updates
every cache buffer in place and computes what the two-row step computes; the bandwidth floor's byte counts."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.bench.bandwidth import decode_step_bytes, weight_bytes
from qnext.config import ModelConfig
from qnext.model.buckets import BucketTable
from qnext.model.cache_layout import cache_layout, model_cache_buffers
from qnext.model.forward import forward
from qnext.model.step_inputs import LayoutSizes, Segment, build_step_inputs
from qnext.model.weights import init_params, param_specs
from qnext.testing.tiny_checkpoint import tiny_hf_config

BS, BLOCKS, ROWS, TABLE = 16, 40, 6, 24      # a block table of several attention spans, as a real max_model_len


@pytest.fixture(scope="module")
def cfg():
    # 64 x 64 states over 4 value heads: 64 KiB a row, so the decode update takes its in-place path (real models')
    hf = tiny_hf_config("qwen3_5", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                        linear_value_head_dim=64)
    return ModelConfig.from_hf_config(hf).with_backend()


def _decode(cfg, rows: int, buffers=None):
    """One decode token of a sequence at position 40 (live row 1), laid out over `rows` decode rows."""
    seg = Segment([7], 40, [1, 2, 3], read_row=1, write_row=1)
    sizes = LayoutSizes(num_tokens=rows, num_decode=rows, num_chunks=0, max_blocks=TABLE, num_logits=rows)
    return build_step_inputs([seg], sizes, block_size=BS, chunk=16)


def _buffers(cfg, seed=0):
    buffers = model_cache_buffers(cfg, num_blocks=BLOCKS, block_size=BS, num_state_rows=ROWS, dtype=np.float32)
    rng = np.random.default_rng(seed)

    def fill(x):                       # history in every row and block but the zero row / dummy block
        x = np.array(rng.normal(size=x.shape) * 0.1, np.float32)
        x[:, 0] = 0.0 if x.ndim == 4 and x.shape[1] == BLOCKS else x[:, 0]
        x[0] = 0.0 if x.shape[0] == ROWS else x[0]
        return jnp.asarray(x)

    return jax.tree.map(fill, buffers)


def test_batch_one_decodes_in_a_one_row_step():
    table = BucketTable(max_num_seqs=16, max_num_batched_tokens=256, max_blocks=8, prefill_chunk=32,
                        max_prefill_groups_extra=8)
    assert [b.sizes.num_decode for b in table.decode] == [1, 2, 4, 8, 16]
    assert table.bucket_for([Segment([3], 10, [1], 1, 1)]).sizes.num_decode == 1


def test_one_row_decode_step_updates_every_cache_buffer_in_place(cfg):
    """A copy of a donated cache buffer costs a step as much as reading every weight again on a big cache: the
    compiled one-row step has none (the KV write, the conv and the recurrent state rows are written in place)."""
    params = jax.tree.map(jnp.asarray, init_params(cfg))
    buffers = _buffers(cfg)
    step = jax.jit(functools.partial(forward, cfg=cfg), donate_argnums=(1,))
    hlo = step.lower(params, buffers, _decode(cfg, 1)).compile().as_text()
    sizes = {x.size for x in jax.tree.leaves(buffers)}          # a buffer or any reshaped view of it
    copies = [line for line in hlo.splitlines()
              if (m := re.search(r"= f32\[([\d,]+)\]\S* copy\(", line)) and np.prod(
                  [int(d) for d in m.group(1).split(",")]) in sizes]
    assert not copies, "\n".join(copies)


def test_one_row_decode_step_equals_the_two_row_step(cfg):
    params = jax.tree.map(jnp.asarray, init_params(cfg, seed=1))
    step = jax.jit(functools.partial(forward, cfg=cfg))
    logits1, after1 = step(params, _buffers(cfg), _decode(cfg, 1))
    logits2, after2 = step(params, _buffers(cfg), _decode(cfg, 2))
    np.testing.assert_allclose(np.asarray(logits1[0]), np.asarray(logits2[0]), rtol=1e-5, atol=1e-5)
    # every KV block but the dummy block 0 and every state row but the zero row 0 (the padding row writes there)
    for a, b in zip(jax.tree.leaves(after1.kv), jax.tree.leaves(after2.kv)):
        np.testing.assert_allclose(np.asarray(a)[:, 1:], np.asarray(b)[:, 1:], rtol=1e-5, atol=1e-6)
    for a, b in zip(after1.conv + after1.recurrent, after2.conv + after2.recurrent):
        np.testing.assert_allclose(np.asarray(a)[1:], np.asarray(b)[1:], rtol=1e-5, atol=1e-6)
    before = _buffers(cfg)
    assert not np.array_equal(np.asarray(after1.recurrent[0][1]), np.asarray(before.recurrent[0][1]))
    np.testing.assert_array_equal(np.asarray(after1.recurrent[0][2:]), np.asarray(before.recurrent[0][2:]))


def test_decode_bytes_count_weights_once_and_each_rows_context_and_state(cfg):
    specs = param_specs(cfg)
    total = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(
        specs, is_leaf=lambda x: hasattr(x, "axes")))
    embed_row = cfg.hidden_size * 4
    assert weight_bytes(cfg, "float32", 1) == total - (cfg.vocab_size - 1) * embed_row
    assert weight_bytes(cfg, "float32", 16) - weight_bytes(cfg, "float32", 1) == 15 * embed_row
    assert weight_bytes(cfg, "bfloat16", 1) < 0.51 * weight_bytes(cfg, "float32", 1)   # A_log, dt_bias stay f32

    layout = cache_layout(cfg, np.float32)
    kv_token = layout.kv_bytes_per_block(1)
    one = decode_step_bytes(cfg, "float32", [100])
    assert decode_step_bytes(cfg, "float32", [101]) - one == kv_token
    # a second row: its context's KV, its new KV, its state read and written, one more embedding row
    assert decode_step_bytes(cfg, "float32", [100, 50]) - one == (
        51 * kv_token + 2 * layout.state_bytes_per_row + embed_row)


def test_expert_bytes_grow_with_the_rows_that_route_to_them():
    moe = ModelConfig.from_hf_config(tiny_hf_config("qwen3_5_moe"))
    one, many = weight_bytes(moe, "float32", 1), weight_bytes(moe, "float32", 4096)
    stacks = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(
        param_specs(moe), is_leaf=lambda x: hasattr(x, "axes")) if s.axes[0] == "expert")
    e, k = moe.num_experts, moe.num_experts_per_tok
    assert many - one == pytest.approx(stacks * (1 - k / e) + 4095 * moe.hidden_size * 4, rel=1e-6)
