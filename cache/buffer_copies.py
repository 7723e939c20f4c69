"""Jitted copies in and out of the device buffers (cache/device_buffers.py), in bounded shapes: the host reading
blocks and rows (the persisted cache, a prefill/decode transfer) and writing ones computed elsewhere, and the gather
and scatter primitives that the host tier's copies (cache/host_tier_buffers.py) and the forks' (cache/fork_buffer_copies.py)
are made of. Index vectors are padded to powers of two so that few shapes compile; padded gathers read block / row 0,
padded scatters write out of range and are dropped (the zero state row is never written); at most MAX_COPY blocks
(rows) go in one call.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cache.device_buffers import LIVE_PART, POOL_PART, CacheBuffers, split_rows, state_part

# Blocks (rows) per jitted copy: bounds the temporary device memory of a gather and the shapes that compile.
MAX_COPY = 256


def gather_device_blocks(kv: tuple, blocks: list[int]) -> tuple:
    """Per KV layer of `kv` (k, v) [Hkv, len(blocks), block_size, D] numpy: the device blocks' contents."""
    pieces = []
    for i in range(0, len(blocks), MAX_COPY):
        part = blocks[i:i + MAX_COPY]
        got = jax.device_get(gather_blocks(kv, padded_indices(part, 0)))
        pieces.append([(k[:, :len(part)], v[:, :len(part)]) for k, v in got])
    return tuple((np.concatenate([p[layer][0] for p in pieces], axis=1),
                  np.concatenate([p[layer][1] for p in pieces], axis=1)) for layer in range(len(kv)))


def gather_device_rows(buffers: CacheBuffers, rows: list[int], layer: int, kind: str) -> np.ndarray:
    """One linear-attention layer's `kind` ("conv" or "recurrent") of the state rows `rows` (live rows or snapshot
    ids), [len(rows), ...] numpy in the stored dtype (the narrowest of the parts read)."""
    parts = split_rows(buffers, rows)
    arrays = {part: state_part(buffers, part)[kind == "recurrent"][layer] for part, _, _ in parts}
    first = arrays.get(LIVE_PART, arrays.get(POOL_PART, getattr(buffers, kind)[layer]))
    dtype = min((a.dtype for a in arrays.values()), key=lambda d: jnp.dtype(d).itemsize, default=first.dtype)
    out = np.zeros((len(rows),) + tuple(first.shape[1:]), jnp.dtype(dtype))
    for part, at, index in parts:
        state = ((arrays[part],), ()) if kind == "conv" else ((), (arrays[part],))
        for i in range(0, len(index), MAX_COPY):
            chunk = index[i:i + MAX_COPY]
            c, r = jax.device_get(gather_rows(state, padded_indices(chunk, 0)))
            out[at[i:i + len(chunk)]] = (c or r)[0][:len(chunk)]
    return out


def gather_live_rows(buffers: CacheBuffers, rows: list[int]) -> tuple[tuple, tuple]:
    """Every linear-attention layer's (conv, recurrent) of the live rows `rows` (the float32 buffers), each
    [len(rows), ...] numpy: one gather and one device-to-host copy for all layers."""
    first = buffers.first_pool_row
    if first is not None and any(row >= first for row in rows):
        raise ValueError(f"rows {rows} include snapshot ids (from {first}): live rows only")
    conv, recurrent = jax.device_get(gather_rows(state_part(buffers, LIVE_PART), padded_indices(rows, 0)))
    return tuple(c[:len(rows)] for c in conv), tuple(r[:len(rows)] for r in recurrent)


def write_blocks_and_rows(buffers: CacheBuffers, blocks: list[int], kv: tuple, rows: list[int], conv: tuple,
                          recurrent: tuple) -> CacheBuffers:
    """Writes KV blocks and state rows computed elsewhere into the buffers (donated) -> the new buffers.
    kv: per KV layer of the buffers (k, v) [Hkv, len(blocks), block_size, D] numpy; conv / recurrent: per
    linear-attention layer [len(rows), ...]; all in the buffers' (global, not per-device) layout."""
    for i in range(0, len(blocks), MAX_COPY):
        part = padded_indices(blocks[i:i + MAX_COPY], buffers.kv[0][0].shape[1])
        values = tuple((padded_values(k[:, i:i + MAX_COPY], len(part), 1),
                        padded_values(v[:, i:i + MAX_COPY], len(part), 1)) for k, v in kv)
        buffers = buffers.replace(kv=scatter_blocks(buffers.kv, part, values))
    for i in range(0, len(rows), MAX_COPY):
        part = padded_indices(rows[i:i + MAX_COPY], buffers.conv[0].shape[0])
        values = (tuple(padded_values(c[i:i + MAX_COPY], len(part), 0) for c in conv),
                  tuple(padded_values(r[i:i + MAX_COPY], len(part), 0) for r in recurrent))
        state = scatter_rows((buffers.conv, buffers.recurrent), part, values)
        buffers = buffers.replace(conv=state[0], recurrent=state[1])
    return buffers


def padded_values(x: np.ndarray, size: int, axis: int) -> np.ndarray:
    """x zero-padded along `axis` to `size` entries (the padded indices write out of range: dropped)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)


def chunks(pairs: dict[int, int]):
    """(keys, values) of `pairs` in pieces of at most MAX_COPY."""
    keys, values = list(pairs), list(pairs.values())
    for i in range(0, len(keys), MAX_COPY):
        yield keys[i:i + MAX_COPY], values[i:i + MAX_COPY]


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_indices(indices: list[int], fill: int, size: int | None = None) -> np.ndarray:
    """indices as int32, padded with `fill` to `size` (default: the next power of two; bounded compilations)."""
    out = np.full(next_pow2(len(indices)) if size is None else size, fill, np.int32)
    out[:len(indices)] = indices
    return out


def page_index(pages, blocks):
    """Index of `blocks` [n] of every head of pages [Hkv, N, bs, D], on the pages' leading dims (head, block):
    pages[page_index(pages, blocks)] is pages[:, blocks]. XLA:GPU rewrites a gather or scatter indexed on other dims
    than the leading ones (pages[:, blocks]) with its operand transposed first: a copy of the whole pages."""
    return jnp.arange(pages.shape[0], dtype=blocks.dtype)[:, None], blocks[None, :]


@jax.jit
def gather_blocks(kv, blocks):   # kv: per layer (k, v) [Hkv, N, bs, D]; blocks [n]
    return tuple((k[page_index(k, blocks)], v[page_index(v, blocks)]) for k, v in kv)


@functools.partial(jax.jit, donate_argnums=0)
def scatter_blocks(kv, blocks, values):   # values: per layer (k, v) [Hkv, n, bs, D]; out-of-range blocks dropped
    return tuple((k.at[page_index(k, blocks)].set(vk.astype(k.dtype), mode="drop"),
                  v.at[page_index(v, blocks)].set(vv.astype(v.dtype), mode="drop"))
                 for (k, v), (vk, vv) in zip(kv, values))


@jax.jit
def gather_rows(state, rows):   # state: (conv, recurrent), per layer [R, ...]; rows [n]
    conv, recurrent = state
    return tuple(c[rows] for c in conv), tuple(r[rows] for r in recurrent)


@functools.partial(jax.jit, donate_argnums=0)
def scatter_rows(state, rows, values):   # out-of-range rows dropped
    (conv, recurrent), (vc, vr) = state, values
    return (tuple(c.at[rows].set(x.astype(c.dtype), mode="drop") for c, x in zip(conv, vc)),
            tuple(r.at[rows].set(x.astype(r.dtype), mode="drop") for r, x in zip(recurrent, vr)))
