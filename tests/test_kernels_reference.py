"""The pure-jnp references against direct oracles on random ragged group layouts.

gated delta rule: chunked reference == token-by-token scan per sequence (outputs, end states, captured states);
conv1d: chunked reference == a direct numpy convolution per sequence; paged attention: reference == dense masked
attention over the gathered KV. The layout builders here are shared with test_kernels_pallas.py.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gdr = importlib.import_module("pallas_kernels.gated_delta_rule")
conv = importlib.import_module("pallas_kernels.causal_conv1d")
attn = importlib.import_module("pallas_kernels.paged_attention")


# ----------------------------------------------------------------------------------------------- state-row layouts
@dataclasses.dataclass
class Segment:
    start: int                 # flat index of the segment's first new token
    num_tokens: int
    read_row: int              # -1: fresh sequence (zero state)
    write_row: int             # live row
    captures: dict             # tokens consumed -> snapshot row


@dataclasses.dataclass
class RowLayout:
    segments: list
    num_rows: int              # R, row 0 is the dummy
    token_index: np.ndarray    # [N, C] flat token per group row, -1 = padding
    length: np.ndarray         # [N]
    read_row: np.ndarray
    write_row: np.ndarray
    capture_row: np.ndarray
    is_first: np.ndarray       # [N] bool
    is_last: np.ndarray

    @property
    def num_tokens(self):
        return sum(s.num_tokens for s in self.segments)

    def rows(self):
        """(length, read_row, write_row, capture_row, is_first, is_last) as jnp arrays."""
        return tuple(jnp.asarray(a) for a in (self.length, self.read_row, self.write_row, self.capture_row,
                                               self.is_first, self.is_last))

    def to_groups(self, flat, rng):
        """[T, ...] -> [N, C, ...]; padding rows get random junk that the ops must ignore."""
        flat = np.asarray(flat)
        junk = rng.normal(size=self.token_index.shape + flat.shape[1:]).astype(flat.dtype)
        idx = self.token_index
        return np.where((idx >= 0).reshape(idx.shape + (1,) * (flat.ndim - 1)), flat[np.maximum(idx, 0)], junk)


def random_row_layout(rng, seg_lens, c, *, num_pad=1, capture_at=None):
    """Segments of the given lengths, cycling through fresh / restored from the live row / restored from a snapshot
    row, each with 1-2 capture cuts (or at the positions `capture_at` gives); cut into groups of <= c tokens (also
    at every capture); `num_pad` padding groups (length 0, writing only to row 0) inserted between segments."""
    next_row = 1
    segments, start = [], 0
    first_kind = rng.integers(3)
    for i, n in enumerate(seg_lens):
        write_row = next_row
        next_row += 1
        kind = (first_kind + i) % 3
        if kind == 0:
            read_row = -1
        elif kind == 1:
            read_row = write_row
        else:
            read_row, next_row = next_row, next_row + 1
        captures = {}
        cuts = rng.choice(np.arange(1, n + 1), size=min(n, 1 + int(rng.integers(2))), replace=False)
        for p in sorted(cuts if capture_at is None else capture_at):
            captures[int(p)], next_row = next_row, next_row + 1
        segments.append(Segment(start, n, read_row, write_row, captures))
        start += n

    groups = []                           # (token_index row, length, read, write, capture, first, last)
    pads = sorted(rng.integers(0, len(segments) + 1, size=num_pad).tolist())
    for i, seg in enumerate(segments + [None]):
        while pads and pads[0] == i:
            pads.pop(0)
            groups.append(([-1] * c, 0, -1, 0, 0, True, True))
        if seg is None:
            break
        s = 0
        while s < seg.num_tokens:
            cuts = [p for p in seg.captures if p > s]
            e = min([s + c, seg.num_tokens] + cuts)
            idx = list(range(seg.start + s, seg.start + e)) + [-1] * (c - (e - s))
            groups.append((idx, e - s, seg.read_row, seg.write_row, seg.captures.get(e, 0), s == 0,
                           e == seg.num_tokens))
            s = e
    cols = list(zip(*groups))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return RowLayout(segments, next_row, np.asarray(cols[0], np.int32), i32(cols[1]), i32(cols[2]), i32(cols[3]),
                     i32(cols[4]), np.asarray(cols[5], bool), np.asarray(cols[6], bool))


def decode_row_layout(rng, num_seqs, *, num_pad=1):
    """One token per sequence (decode view); each row reads its live row, a snapshot or zeros; some capture."""
    segments, rows = [], []
    next_row = 1
    for i in range(num_seqs):
        write_row = next_row
        read_row = [-1, write_row, next_row + 1][rng.integers(3)]
        next_row += 1 + (read_row > write_row)
        captures = {}
        if rng.random() < 0.4:
            captures[1], next_row = next_row, next_row + 1
        segments.append(Segment(i, 1, read_row, write_row, captures))
        rows.append((read_row, write_row, captures.get(1, 0)))
    for _ in range(num_pad):
        rows.insert(int(rng.integers(len(rows) + 1)), (-1, 0, 0))
    read_row, write_row, capture_row = (np.asarray(x, np.int32) for x in zip(*rows))
    token_index = np.full((len(rows), 1), -1, np.int32)
    token_index[write_row > 0, 0] = np.arange(num_seqs)
    ones = np.ones(len(rows), bool)
    return RowLayout(segments, next_row, token_index, (write_row > 0).astype(np.int32), read_row, write_row,
                     capture_row, ones, ones)


# ------------------------------------------------------------------------------------------------ gated delta rule
def gdr_inputs(rng, num_tokens, hk, hv, dk, dv, num_rows, dtype=np.float32):
    """Flat per-token inputs as the model produces them (L2-normalised q, k; q scaled) and a random state pool."""
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(num_tokens, hk, dk))) * dk ** -0.5
    k = unit(rng.normal(size=(num_tokens, hk, dk)))
    v = rng.normal(size=(num_tokens, hv, dv))
    g = -rng.uniform(0.01, 0.4, size=(num_tokens, hv))
    beta = rng.uniform(0.05, 0.95, size=(num_tokens, hv))
    pool = 0.5 * rng.normal(size=(num_rows, hv, dk, dv))
    pool[0] = 0.0                                    # row 0 is the zero state (docs/CONTRACTS.md)
    return (q.astype(dtype), k.astype(dtype), v.astype(dtype), g.astype(np.float32), beta.astype(np.float32),
            pool.astype(np.float32))


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
@dataclasses.dataclass
class AttnLayout:
    block_table: np.ndarray    # [N, MB]
    kv_len: np.ndarray         # [N]
    q_pos: np.ndarray          # [N, L], -1 = padding row
    num_blocks: int


def random_attn_layout(rng, seqs, group_len, block_size, *, num_pad=1):
    """seqs: (cached prefix length, new tokens) per sequence. Each sequence's new tokens are cut into groups of
    `group_len` rows (1 = decode view); pages are a random permutation of blocks 1.. (block 0 is the dummy)."""
    pages_per_seq = [-(-(p + q) // block_size) for p, q in seqs]
    mb = max(pages_per_seq)
    perm = rng.permutation(np.arange(1, 1 + sum(pages_per_seq) + 3))
    tables, used = [], 0
    for n in pages_per_seq:
        tables.append(np.pad(perm[used:used + n], (0, mb - n)))
        used += n
    rows = []
    for (prefix, new), table in zip(seqs, tables):
        for s in range(0, new, group_len):
            pos = np.arange(prefix + s, prefix + min(s + group_len, new))
            rows.append((table, prefix + new, np.pad(pos, (0, group_len - len(pos)), constant_values=-1)))
    for _ in range(num_pad):
        rows.insert(int(rng.integers(len(rows) + 1)), (np.zeros(mb, np.int64), 0, np.full(group_len, -1)))
    table, kv_len, q_pos = zip(*rows)
    return AttnLayout(np.asarray(table, np.int32), np.asarray(kv_len, np.int32), np.asarray(q_pos, np.int32),
                      int(perm.max()) + 1)


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


def attn_inputs(rng, layout, hq, hkv, d, block_size, dtype=np.float32):
    n, length = layout.q_pos.shape
    q = rng.normal(size=(n, length, hq, d)).astype(dtype)
    k_pages = rng.normal(size=(hkv, layout.num_blocks, block_size, d)).astype(dtype)
    v_pages = rng.normal(size=(hkv, layout.num_blocks, block_size, d)).astype(dtype)
    return q, k_pages, v_pages


ATTN_CASES = {  # name: (seqs (prefix, new), group_len)
    "decode": (((15, 1), (0, 1), (31, 1), (40, 1)), 1),
    "prefill": (((0, 40), (16, 16), (5, 27)), 16),
    "mixed": (((47, 1), (0, 33), (32, 16), (3, 2)), 16),
}


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
