"""The pure-jnp references against direct oracles on random ragged group layouts.

gated delta rule: chunked reference == token-by-token scan per sequence (outputs, end states, captured states);
conv1d: chunked reference == a direct numpy convolution per sequence; paged attention: reference == dense masked
attention over the gathered KV. The input builders are in tests/support/kernel_cases.py.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.kernel_cases import (ATTN_CASES, attn_inputs, decode_row_layout, gdr_inputs, random_attn_layout,
                                         random_row_layout)

gdr = importlib.import_module("pallas_kernels.gated_delta_rule")
conv = importlib.import_module("pallas_kernels.causal_conv1d")
attn = importlib.import_module("pallas_kernels.paged_attention")


# ------------------------------------------------------------------------------------------------ gated delta rule
@jax.jit
def _batched_token_scan(q, k, v, g, beta, s0):
    return jax.vmap(gdr.gated_delta_rule_token_scan)(q, k, v, g, beta, s0)


def gdr_expected(layout, q, k, v, g, beta, pool):
    """Token-scan oracle: per-token outputs [T, Hv, dv] and the expected pool (row 0 excluded from checks).
    Every sequence (and every captured prefix) is one batch entry padded with k = beta = g = 0 tokens, which leave
    the state unchanged, so the scan compiles once."""
    t_max = max(s.num_tokens for s in layout.segments)
    runs = [(s, s.num_tokens, None) for s in layout.segments]
    runs += [(s, p, row) for s in layout.segments for p, row in s.captures.items()]
    sel = np.zeros((len(runs), t_max), np.int64)
    live = np.zeros((len(runs), t_max), bool)
    for i, (s, n, _) in enumerate(runs):
        sel[i, :n], live[i, :n] = np.arange(s.start, s.start + n), True

    def take(x):
        m = live.reshape(live.shape + (1,) * (x.ndim - 1))
        return np.where(m, np.asarray(x, np.float32)[sel], 0.0)

    s0 = np.stack([pool[s.read_row] if s.read_row >= 0 else np.zeros_like(pool[0]) for s, _, _ in runs])
    o, s_end = _batched_token_scan(take(q), take(k), take(v), take(g), take(beta), s0)
    o, s_end = np.asarray(o), np.asarray(s_end)
    out = np.zeros((layout.num_tokens,) + v.shape[1:], np.float32)
    want = np.array(pool)
    for i, (s, n, row) in enumerate(runs):
        if row is None:
            out[s.start:s.start + n] = o[i, :n]
            want[s.write_row] = s_end[i]
        else:
            want[row] = s_end[i]
    return out, want


def assert_group_outputs(layout, got, want_flat, **tol):
    """got [N, C, ...] valid rows == the flat oracle; padding rows == 0."""
    got = np.asarray(got)
    idx = layout.token_index
    np.testing.assert_allclose(got[idx >= 0], want_flat[idx[idx >= 0]], **tol)
    assert not np.any(got[idx < 0]), "padding rows must be 0"


def _fresh_jit(fn):
    """jax.jit of a new function object: jit's trace cache is keyed on the function, not on the module constant
    the in-place tests patch, so jit(fn) would reuse another test's trace of the other path."""
    return jax.jit(lambda *args: fn(*args))


@pytest.mark.parametrize("seed, seg_lens, c, hk, hv", [
    (0, (37, 64, 5), 16, 2, 2),
    (1, (130, 1, 70), 64, 1, 2),
    (2, (16, 33, 17, 2), 16, 1, 4),
])
def test_chunked_gated_delta_rule_reference_matches_token_scan(seed, seg_lens, c, hk, hv):
    rng = np.random.default_rng(seed)
    check_chunked_against_token_scan(rng, random_row_layout(rng, seg_lens, c, num_pad=2), hk, hv)


def check_chunked_against_token_scan(rng, layout, hk, hv):
    """The chunked reference over `layout` equals the per-sequence token scan; returns the new pool."""
    q, k, v, g, beta, pool = gdr_inputs(rng, layout.num_tokens, hk, hv, 16, 8, layout.num_rows)
    want_o, want_pool = gdr_expected(layout, q, k, v, g, beta, pool)
    groups = [layout.to_groups(x, rng) for x in (q, k, v, g, beta)]
    o, new_pool = _fresh_jit(gdr.chunk_gated_delta_rule_reference)(*groups, jnp.asarray(layout.length),
                                                                   jnp.asarray(pool), *layout.rows()[1:])
    assert_group_outputs(layout, o, want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(new_pool)[1:], want_pool[1:], rtol=1e-4, atol=1e-4)
    return np.asarray(new_pool)


def with_trailing_padding(layout, count):
    """The layout with `count` padding groups appended (a bucket's unused groups come last)."""
    def pad(a, value):
        return np.concatenate([a, np.full((count,) + a.shape[1:], value, a.dtype)])

    return dataclasses.replace(
        layout, token_index=pad(layout.token_index, -1), length=pad(layout.length, 0),
        read_row=pad(layout.read_row, -1), write_row=pad(layout.write_row, 0),
        capture_row=pad(layout.capture_row, 0), is_first=pad(layout.is_first, True),
        is_last=pad(layout.is_last, True))


@pytest.mark.parametrize("trailing", [1, 2, 5])
def test_chunked_gated_delta_rule_stops_after_the_last_group_with_tokens(trailing):
    """The group loop's trip count follows the last group with tokens (taken two groups at a time when N is
    even): every real group still runs, whatever the parity of N and of the used count."""
    rng = np.random.default_rng(10 + trailing)
    layout = with_trailing_padding(random_row_layout(rng, (23, 9, 16), 8, num_pad=1), trailing)
    new_pool = check_chunked_against_token_scan(rng, layout, 1, 2)
    assert not np.any(new_pool[0]), "row 0 must stay the zero state"


@pytest.mark.parametrize("in_place", [False, True], ids=["batched", "row-by-row"])
def test_recurrent_gated_delta_rule_reference_matches_token_scan(in_place, monkeypatch):
    if in_place:                                      # the path real-size states take (test states are small)
        monkeypatch.setattr(gdr, "_IN_PLACE_ROW_BYTES", 0)
    rng = np.random.default_rng(3)
    layout = decode_row_layout(rng, 5, num_pad=2)
    q, k, v, g, beta, pool = gdr_inputs(rng, 5, 2, 4, 16, 8, layout.num_rows)
    want_o, want_pool = gdr_expected(layout, q, k, v, g, beta, pool)
    groups = [layout.to_groups(x, rng)[:, 0] for x in (q, k, v, g, beta)]
    o, new_pool = _fresh_jit(gdr.recurrent_gated_delta_rule_reference)(*groups, jnp.asarray(pool),
                                                                       *layout.rows()[1:4])
    live = layout.write_row > 0
    np.testing.assert_allclose(np.asarray(o)[live], want_o[layout.token_index[live, 0]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_pool)[1:], want_pool[1:], rtol=1e-5, atol=1e-5)
    if in_place:                                      # padding rows are skipped, not computed
        assert not np.any(np.asarray(o)[~live])


# ----------------------------------------------------------------------------------------------------- conv1d
def conv_expected(layout, x, weight, conv_state):
    """Direct numpy conv per sequence over [initial window | x]: outputs [T, D] and the expected state pool."""
    x, w = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    width = w.shape[1]
    out = np.zeros(x.shape, np.float64)
    want = np.array(conv_state)
    for s in layout.segments:
        init = np.asarray(conv_state[s.read_row], np.float64) if s.read_row >= 0 else np.zeros((width - 1, x.shape[1]))
        ext = np.concatenate([init, x[s.start:s.start + s.num_tokens]])
        for t in range(s.num_tokens):
            acc = np.sum(ext[t:t + width] * w.T, axis=0)
            out[s.start + t] = acc / (1.0 + np.exp(-acc))
        want[s.write_row] = ext[s.num_tokens:]
        for p, row in s.captures.items():
            want[row] = ext[p:p + width - 1]
    return out, want


@pytest.mark.parametrize("seed, seg_lens, c, capture_at", [
    (0, (37, 2, 64), 16, None),
    (1, (1, 3, 90), 64, None),
    (2, (20, 20, 20), 16, (1, 2, 3, 5, 6)),     # runs of groups shorter than the halo: tails reach back 3 groups
])
def test_causal_conv1d_chunked_reference_matches_direct_conv(seed, seg_lens, c, capture_at):
    rng = np.random.default_rng(seed)
    layout = random_row_layout(rng, seg_lens, c, num_pad=2, capture_at=capture_at)
    d, width = 24, 4
    x = rng.normal(size=(layout.num_tokens, d)).astype(np.float32)
    weight = rng.normal(size=(d, width)).astype(np.float32)
    pool = rng.normal(size=(layout.num_rows, width - 1, d)).astype(np.float32)
    pool[0] = 0.0                                    # row 0 is the zero state
    want_y, want_pool = conv_expected(layout, x, weight, pool)
    y, new_pool = jax.jit(conv.causal_conv1d_chunked_reference)(jnp.asarray(layout.to_groups(x, rng)),
                                                                jnp.asarray(weight), jnp.asarray(pool),
                                                                *layout.rows())
    assert_group_outputs(layout, y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_pool)[1:], want_pool[1:], rtol=1e-6, atol=1e-6)


def test_causal_conv1d_update_reference_matches_direct_conv():
    rng = np.random.default_rng(4)
    layout = decode_row_layout(rng, 6, num_pad=1)
    d, width = 24, 4
    x = rng.normal(size=(6, d)).astype(np.float32)
    weight = rng.normal(size=(d, width)).astype(np.float32)
    pool = rng.normal(size=(layout.num_rows, width - 1, d)).astype(np.float32)
    pool[0] = 0.0                                    # row 0 is the zero state
    want_y, want_pool = conv_expected(layout, x, weight, pool)
    y, new_pool = jax.jit(conv.causal_conv1d_update_reference)(jnp.asarray(layout.to_groups(x, rng)[:, 0]),
                                                               jnp.asarray(weight), jnp.asarray(pool),
                                                               *layout.rows()[1:4])
    live = layout.write_row > 0
    np.testing.assert_allclose(np.asarray(y)[live], want_y[layout.token_index[live, 0]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_pool)[1:], want_pool[1:], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ paged attention
def dense_attention(q, k_pages, v_pages, layout, sm_scale):
    """Dense masked attention over each group's gathered KV, float64: [N, L, Hq, D]."""
    q, kp, vp = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    n, length, hq, d = q.shape
    hkv = kp.shape[0]
    out = np.zeros(q.shape)
    for i in range(n):
        keys = kp[:, layout.block_table[i]].reshape(hkv, -1, d).transpose(1, 0, 2)     # [MB*bs, Hkv, D]
        vals = vp[:, layout.block_table[i]].reshape(hkv, -1, d).transpose(1, 0, 2)
        for l in range(length):
            visible = min(layout.kv_len[i], layout.q_pos[i, l] + 1)
            if visible <= 0:
                continue
            for h in range(hq):
                kv_h = h // (hq // hkv)
                s = keys[:visible, kv_h] @ q[i, l, h] * sm_scale
                p = np.exp(s - s.max())
                out[i, l, h] = p @ vals[:visible, kv_h] / p.sum()
    return out


@pytest.mark.parametrize("leading_gather", [False, True], ids=["cpu_gather", "gpu_gather"])
@pytest.mark.parametrize("case", sorted(ATTN_CASES))
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2), (8, 2)])
def test_paged_attention_reference_matches_dense(case, hq, hkv, leading_gather):
    seqs, group_len = ATTN_CASES[case]
    rng = np.random.default_rng(hq)
    block_size, d = 16, 16
    layout = random_attn_layout(rng, seqs, group_len, block_size, num_pad=1)
    q, k_pages, v_pages = attn_inputs(rng, layout, hq, hkv, d, block_size)
    want = dense_attention(q, k_pages, v_pages, layout, 0.3)
    reference = jax.jit(functools.partial(attn.paged_attention_reference, sm_scale=0.3, span_blocks=2,
                                          leading_gather=leading_gather))
    got = reference(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(layout.block_table),
                    jnp.asarray(layout.kv_len), jnp.asarray(layout.q_pos))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("write", ["write_kv_reference", "write_kv_leading"])
def test_write_kv_puts_each_token_at_its_slot_of_every_head(write):
    """Both forms (the CPU one and the GPU one that indexes the pages' leading dims) write the same slots."""
    rng = np.random.default_rng(7)
    hkv, num_blocks, block_size, d = 2, 5, 4, 8
    k_pages = rng.normal(size=(hkv, num_blocks, block_size, d)).astype(np.float32)
    v_pages = rng.normal(size=(hkv, num_blocks, block_size, d)).astype(np.float32)
    slots = np.array([5, 19, 6, 12], np.int32)                    # blocks 1, 4, 1, 3
    k, v = (rng.normal(size=(len(slots), hkv, d)).astype(np.float32) for _ in range(2))
    got_k, got_v = jax.jit(getattr(attn, write))(jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(k),
                                                 jnp.asarray(v), jnp.asarray(slots))
    want_k, want_v = k_pages.copy(), v_pages.copy()
    for t, s in enumerate(slots):
        want_k[:, s // block_size, s % block_size] = k[t]
        want_v[:, s // block_size, s % block_size] = v[t]
    np.testing.assert_array_equal(np.asarray(got_k), want_k)
    np.testing.assert_array_equal(np.asarray(got_v), want_v)
