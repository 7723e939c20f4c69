"""The vision tower (Qwen3-VL ViT without deepstack) as pure-functional JAX:
`encode(vision_params, pixel_values, grid_thw, cfg) -> [num_tokens, out_hidden_size]`.

    x = patch_embed(pixels)                       one linear map of each (C, tp, p, p) cube (the Conv3d with stride =
                                                  kernel), plus bias
    x += bilinear(pos_embed)(row, col)            learned square table resampled to the grid
    depth x: x += attn(LN1(x)); x += mlp(LN2(x))  LayerNorm eps 1e-6; non-causal attention within each frame group
                                                  only, q and k rotated by the 2-D RoPE (rows then columns);
                                                  MLP fc1 -> gelu (tanh) -> fc2
    merger: LN(x) per patch, 4 adjacent patches (a merge block) concatenated -> fc1 -> gelu (erf) -> fc2
Parameters (qnext/model/vision_weights.py loads them): matrices in nn.Linear's [out, in] layout;
    {"patch_embed": {"weight" [hidden, C*tp*p*p], "bias"}, "pos_embed": [num_position_embeddings, hidden],
     "blocks": ({"norm1_weight", "norm1_bias", "qkv_weight" [3*hidden, hidden], "qkv_bias", "proj_weight",
                 "proj_bias", "norm2_weight", "norm2_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"}, ...),
     "merger": {"norm_weight", "norm_bias", "fc1_weight" [4*hidden, 4*hidden], "fc1_bias", "fc2_weight"
                [out_hidden, 4*hidden], "fc2_bias"}}
Numerics: LayerNorm statistics, the rotation and the attention softmax in float32.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qnext.ops.linear import linear
from qnext.vision.config import VisionConfig
from qnext.vision.grid_tables import position_embedding_taps, rotary_angles

ATTENTION_SCORES_BYTES = 1 << 30   # a frame's attention scores beyond this go chunk by chunk of queries
_HIGHEST = jax.lax.Precision.HIGHEST


def as_grids(grid_thw) -> tuple[tuple[int, int, int], ...]:
    """One (t, h, w) or a sequence of them -> a tuple of int triples (hashable: a static jit argument)."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return tuple(tuple(int(v) for v in g) for g in grid)


def num_patches(grids: Sequence[tuple[int, int, int]]) -> int:
    return sum(t * h * w for t, h, w in grids)


def encode(vision_params, pixel_values, grid_thw, cfg: VisionConfig):
    """pixel_values: [num_patches, C*tp*p*p] of one or more images / videos, concatenated in order; grid_thw: their
    (t, h, w) grids (static). Returns [sum of num_tokens, out_hidden_size] in the params' dtype: each input's
    tokens in prompt order."""
    grids = as_grids(grid_thw)
    expected = num_patches(grids)
    if pixel_values.shape != (expected, cfg.patch_dim):
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grids {grids} need "
                         f"({expected}, {cfg.patch_dim})")
    for t, h, w in grids:
        if h % cfg.spatial_merge_size or w % cfg.spatial_merge_size:
            raise ValueError(f"grid {(t, h, w)} is not a multiple of the merge size {cfg.spatial_merge_size}")
    dtype = vision_params["pos_embed"].dtype
    x = linear(pixel_values.astype(dtype), vision_params["patch_embed"]["weight"]) + vision_params["patch_embed"]["bias"]
    x = x + _position_embeddings(vision_params["pos_embed"], grids, cfg).astype(dtype)
    angles = jnp.asarray(np.concatenate([rotary_angles(g, cfg) for g in grids]))           # [N, head_dim / 2]
    cos = jnp.cos(jnp.concatenate([angles, angles], axis=-1))[:, None, :]                  # [N, 1, head_dim]
    sin = jnp.sin(jnp.concatenate([angles, angles], axis=-1))[:, None, :]
    for i, block in enumerate(vision_params["blocks"]):
        with jax.named_scope(f"vision_block_{i}"):
            x = x + _attention(block, _layer_norm(x, block["norm1_weight"], block["norm1_bias"], cfg), cos, sin,
                               grids, cfg)
            h = _layer_norm(x, block["norm2_weight"], block["norm2_bias"], cfg)
            h = linear(h, block["fc1_weight"]) + block["fc1_bias"]
            h = jax.nn.gelu(h, approximate=cfg.hidden_act == "gelu_pytorch_tanh")
            x = x + linear(h, block["fc2_weight"]) + block["fc2_bias"]
    return _merge(vision_params["merger"], x, cfg)


@functools.lru_cache(maxsize=None)
def make_encode(cfg: VisionConfig):
    """encode jitted for one tower config; grid_thw is static (one compilation per distinct set of grids)."""
    jitted = jax.jit(encode, static_argnames=("grid_thw", "cfg"))
    return lambda params, pixel_values, grid_thw: jitted(params, pixel_values, grid_thw=as_grids(grid_thw), cfg=cfg)


def _position_embeddings(table, grids, cfg: VisionConfig):
    taps = [position_embedding_taps(g, cfg) for g in grids]
    indices = jnp.asarray(np.concatenate([i for i, _ in taps]))                           # [N, 4]
    weights = jnp.asarray(np.concatenate([w for _, w in taps]))                           # [N, 4] float32
    return (table[indices].astype(jnp.float32) * weights[..., None]).sum(axis=1)


def _layer_norm(x, weight, bias, cfg: VisionConfig):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + cfg.layer_norm_eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _rotate(x, cos, sin):
    """NeoX rotation of the whole head dim in float32: x * cos + [-x2, x1] * sin."""
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _attention(block, x, cos, sin, grids, cfg: VisionConfig):
    """x: [N, hidden]. Each frame group of each input attends to itself only (no mask across frames)."""
    n, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
    qkv = (linear(x, block["qkv_weight"]) + block["qkv_bias"]).reshape(n, 3, heads, d)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    outs, start = [], 0
    for t, h, w in grids:
        size = t * h * w
        frame = lambda a: a[start:start + size].reshape(t, h * w, heads, d)   # noqa: E731
        outs.append(_frame_attention(frame(q), frame(k), frame(v)).reshape(size, heads * d))
        start += size
    out = jnp.concatenate(outs).astype(x.dtype) if len(outs) > 1 else outs[0].astype(x.dtype)
    return linear(out, block["proj_weight"]) + block["proj_bias"]


def query_chunk(frames: int, length: int, heads: int, budget: int = ATTENTION_SCORES_BYTES) -> int:
    """Queries per chunk so that one chunk's float32 scores [frames, heads, chunk, length] stay within `budget`
    (a power of two >= 128), or `length` when the whole frame fits."""
    if frames * heads * length * length * 4 <= budget:
        return length
    fit = budget // (frames * heads * length * 4)
    return max(128, 1 << max(fit, 1).bit_length() - 1)


def _frame_attention(q, k, v, chunk: int | None = None):
    """q, k, v: [F, L, heads, d] -> [F, L, heads, d] float32, softmax(q k^T / sqrt(d)) v per frame, queries in
    chunks of `chunk` (default: query_chunk's) run one after another."""
    length, d = q.shape[1], q.shape[-1]
    chunk = chunk or query_chunk(q.shape[0], length, q.shape[2])

    def attend(q_chunk):
        scores = jnp.einsum("fqhd,fkhd->fhqk", q_chunk.astype(jnp.float32) * d ** -0.5, k.astype(jnp.float32),
                            precision=_HIGHEST)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("fhqk,fkhd->fqhd", probs, v.astype(jnp.float32), precision=_HIGHEST)

    if length <= chunk:
        return attend(q)
    chunks = -(-length // chunk)
    padded = jnp.pad(q, ((0, 0), (0, chunks * chunk - length), (0, 0), (0, 0)))
    stacked = padded.reshape(q.shape[0], chunks, chunk, *q.shape[2:]).swapaxes(0, 1)
    out = jax.lax.map(attend, stacked)                                   # [chunks, F, chunk, heads, d]
    return out.swapaxes(0, 1).reshape(q.shape[0], -1, *q.shape[2:])[:, :length]


def _merge(p, x, cfg: VisionConfig):
    """[N, hidden] -> [N / 4, out_hidden]: each merge block's patches (adjacent rows) become one token."""
    h = _layer_norm(x, p["norm_weight"], p["norm_bias"], cfg).reshape(-1, cfg.hidden_size * cfg.merge_unit)
    h = jax.nn.gelu(linear(h, p["fc1_weight"]) + p["fc1_bias"], approximate=False)
    return linear(h, p["fc2_weight"]) + p["fc2_bias"]
