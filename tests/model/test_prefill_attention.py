"""The jnp prefill attention by sequence (qnext/model/prefill_attention.py) equals the group-wise reference, and the
engine's step on CPU uses it: a sequence holding half the view's groups is one group of all the view's rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention_reference
from qnext.model import prefill_attention
from qnext.model.groups import query_positions
from qnext.model.step_inputs import Segment, build_step_inputs, required_sizes

BS, CHUNK, HQ, HKV, D = 4, 4, 4, 2, 8


def _layout(extra_groups=2):
    """Three prefilling sequences with cached prefixes (one cut at a capture mid-chunk), one decode, padding."""
    segments = [
        Segment(token_ids=list(range(10)), start=6, block_table=[1, 2, 3, 4], read_row=1, write_row=1,
                captures={8: 5}),                                       # groups 6-8 | 8-12 | 12-16: cut at 8
        Segment(token_ids=[7], start=9, block_table=[5, 6, 7], read_row=2, write_row=2),      # decode
        Segment(token_ids=list(range(3)), start=13, block_table=[8, 9, 10, 11], read_row=3, write_row=3),
        Segment(token_ids=list(range(17)), start=0, block_table=[12, 13, 14, 15, 16], read_row=-1, write_row=4),
    ]
    need = required_sizes(segments, CHUNK)
    sizes = type(need)(**{**need.__dict__, "num_chunks": need.num_chunks + extra_groups})
    return build_step_inputs(segments, sizes, block_size=BS, chunk=CHUNK)


def _case(seed=0, extra_groups=2):
    inputs = _layout(extra_groups)
    rng = np.random.default_rng(seed)
    groups = inputs.prefill
    n = groups.length.shape[0]
    q = jnp.asarray(rng.standard_normal((n, CHUNK, HQ, D)), jnp.float32)
    k_pages = jnp.asarray(rng.standard_normal((HKV, 17, BS, D)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((HKV, 17, BS, D)), jnp.float32)
    q_pos = query_positions(jax.tree.map(jnp.asarray, groups), jnp.asarray(inputs.positions))
    return inputs, groups, q, k_pages, v_pages, q_pos


@pytest.mark.parametrize("extra_groups,big", [(2, False), (0, True)])
def test_by_sequence_equals_group_wise_reference(extra_groups, big):
    """Runs of 3, 1 and 5 groups (the first cut at a capture) in 9 or 11 groups: the 5-group run takes the
    whole-view window in 9 groups, not in 11."""
    inputs, groups, q, k_pages, v_pages, q_pos = _case(extra_groups=extra_groups)
    assert list(groups.length) == [2, 4, 4, 3, 4, 4, 4, 4, 1] + [0] * extra_groups   # the layout meant
    start, end, size = prefill_attention.largest_run(jnp.asarray(groups.is_first), jnp.asarray(groups.length))
    assert (int(start), int(end), int(size)) == (4, 9, 5) and (2 * int(size) >= len(groups.length)) == big
    want = paged_attention_reference(q, k_pages, v_pages, jnp.asarray(groups.block_table), jnp.asarray(groups.kv_len),
                                     q_pos, sm_scale=0.3)
    got = jax.jit(lambda *a: prefill_attention.prefill_attention_by_sequence(*a, sm_scale=0.3))(
        q, k_pages, v_pages, groups.block_table, groups.kv_len, q_pos, groups.is_first, groups.length)
    valid = np.asarray(q_pos) >= 0
    assert valid.sum() == 30 and np.all(np.asarray(got)[~valid] == 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_cpu_step_reads_a_long_prefill_once(monkeypatch):
    """Traced through the engine's attention layer, the reference sees the whole-view window (one group of all the
    view's rows) and the group-wise rest (the old path: only the call over all groups of 4 rows)."""
    from qnext.config import ModelConfig
    from qnext.model import attention

    calls = []

    def spy(q, *args, **kwargs):
        calls.append(q.shape)
        return paged_attention_reference(q, *args, **kwargs)

    monkeypatch.setattr(prefill_attention, "paged_attention_reference", spy)
    from qnext.testing.tiny_checkpoint import tiny_hf_config

    cfg = ModelConfig.from_hf_config(tiny_hf_config("qwen3_5", hidden_size=16, num_attention_heads=HQ,
                                                    num_key_value_heads=HKV, head_dim=D)).with_backend("cpu")
    assert cfg.kernels == "reference"
    inputs, groups, *_ = _case(extra_groups=prefill_attention.MIN_GROUPS - 9)
    rng = np.random.default_rng(1)
    p = {"qkv_proj": jnp.asarray(rng.standard_normal((2 * HQ * D + 2 * HKV * D, 16)) * 0.1, jnp.float32),
         "q_norm": jnp.ones(D), "k_norm": jnp.ones(D),
         "o_proj": jnp.asarray(rng.standard_normal((16, HQ * D)) * 0.1, jnp.float32)}
    kv = (jnp.zeros((HKV, 17, BS, D)), jnp.zeros((HKV, 17, BS, D)))
    x = jnp.asarray(rng.standard_normal((inputs.token_ids.shape[0], 16)), jnp.float32)
    jax.eval_shape(lambda x, kv, inputs: attention.full_attention(p, x, kv, inputs, cfg), x, kv, inputs)
    n = groups.length.shape[0]
    assert sorted(calls) == [(1, n * CHUNK, HQ, D), (n, CHUNK, HQ, D)]
