"""The step's flat batch and its two group views, checked against the layout contract (docs/CONTRACTS.md)."""
from __future__ import annotations

import numpy as np
import pytest

from qnext.model.step_inputs import LayoutSizes, Segment, build_step_inputs, group_bounds, required_sizes

BS, CHUNK, MB = 4, 8, 8


def mixed_segments(rng):
    """Decode rows interleaved with prefill segments (one cut by captures, one asking for every logit)."""
    blocks = iter(rng.permutation(np.arange(1, 200)).tolist())

    def seg(start, n, read_row, write_row, captures=None, all_logits=False):
        table = [next(blocks) for _ in range(-(-(start + n) // BS))]
        return Segment(rng.integers(0, 100, n).tolist(), start, table, read_row, write_row, captures or {},
                       all_logits)

    return [seg(9, 1, 1, 1), seg(0, 13, -1, 2, {4: 20, 12: 21}), seg(11, 1, 3, 3, {12: 22}), seg(3, 1, 4, 4),
            seg(5, 9, 5, 5, all_logits=True), seg(15, 1, 23, 6)]


def test_flat_batch_and_group_views_follow_the_layout_contract():
    segments = mixed_segments(np.random.default_rng(0))
    need = required_sizes(segments, CHUNK)
    sizes = LayoutSizes(need.num_tokens + 3, need.num_decode + 2, need.num_chunks + 2, MB, need.num_logits + 1)
    inp = build_step_inputs(segments, sizes, block_size=BS, chunk=CHUNK)
    dec, pre = inp.decode, inp.prefill

    flat = logit = decode_row = 0
    for seg in segments:
        n = len(seg.token_ids)
        pos = np.arange(seg.start, seg.start + n)
        idx = np.arange(flat, flat + n)
        np.testing.assert_array_equal(inp.token_ids[idx], seg.token_ids)
        np.testing.assert_array_equal(inp.positions[idx], pos)
        np.testing.assert_array_equal(inp.slot_mapping[idx], np.asarray(seg.block_table)[pos // BS] * BS + pos % BS)
        wanted = idx if seg.all_logits else idx[-1:]
        np.testing.assert_array_equal(inp.logits_index[logit:logit + len(wanted)], wanted)
        logit += len(wanted)
        for t in idx:                                   # the row of a view that holds each token
            src = inp.token_source[t]
            if n == 1:
                assert src == decode_row and dec.token_index[src, 0] == t
            else:
                g, row = divmod(src - sizes.num_decode, CHUNK)
                assert pre.token_index[g, row] == t and row < pre.length[g]
        if n == 1:                                      # one decode group per one-token segment, in order
            r = decode_row
            assert (dec.length[r], dec.kv_len[r], dec.read_row[r], dec.write_row[r]) == (1, seg.start + 1,
                                                                                       seg.read_row, seg.write_row)
            assert dec.is_first[r] and dec.is_last[r]
            assert dec.capture_row[r] == seg.captures.get(seg.start + 1, 0)
            np.testing.assert_array_equal(dec.block_table[r], np.pad(seg.block_table, (0, MB - len(seg.block_table))))
            decode_row += 1
        else:                                           # prefill groups cut at every chunk and capture
            first = inp.token_source[flat] - sizes.num_decode
            bounds = group_bounds(seg.start, seg.start + n, seg.captures, CHUNK)
            for j, (lo, hi) in enumerate(bounds):
                g = (first // CHUNK) + j
                assert pre.length[g] == hi - lo and pre.kv_len[g] == seg.start + n
                assert pre.read_row[g] == (seg.read_row if j == 0 else -1) and pre.write_row[g] == seg.write_row
                assert (pre.is_first[g], pre.is_last[g]) == (j == 0, j == len(bounds) - 1)
                assert pre.capture_row[g] == seg.captures.get(hi, 0)
        flat += n
    # padding rows of both views point nowhere: no tokens, zero state in, nothing written
    for view, used in ((dec, decode_row), (pre, need.num_chunks)):
        assert not view.length[used:].any() and not view.write_row[used:].any()
        assert not view.capture_row[used:].any() and (view.read_row[used:] == -1).all()


@pytest.mark.parametrize("bad, message", [
    (Segment([1], 8, [1], 1, 1), "cannot hold"),
    (Segment([1], 3, [1], 1, 1, {7: 9}), "outside the segment"),
])
def test_bad_segments_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        build_step_inputs([bad], LayoutSizes(4, 4, 2, MB, 4), block_size=BS, chunk=CHUNK)
