"""Random ragged kernel inputs: state-row group layouts (prefill and decode views), gated-delta-rule inputs, paged
attention layouts, and the attention cases; shared by the reference, Pallas and Mosaic kernel tests."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


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
