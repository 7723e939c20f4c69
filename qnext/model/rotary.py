"""Partial NeoX-style rotary embedding on the first `rotary_dim` dims of each head."""
from __future__ import annotations

import jax.numpy as jnp

from qnext.config import ModelConfig
from qnext.model.rope import rope_frequencies
from qnext.vision.mrope import DEFAULT_MROPE_SECTION, mrope_angles


def apply_rotary(x, positions, cfg: ModelConfig):
    """x: [..., T, heads, D]; positions: [..., T], or [3, ..., T] (t, h, w) for Qwen3.5's interleaved MRoPE.
    Pairs (i, i + rotary_dim/2) rotate; dims past rotary_dim pass through."""
    inv_freq, scaling = rope_frequencies(cfg)
    rd = cfg.rotary_dim
    if positions.ndim == x.ndim - 1:                                                          # 3-D positions
        angles = mrope_angles(positions, inv_freq, cfg.mrope_section or DEFAULT_MROPE_SECTION)  # [..., T, rd/2]
    else:
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)            # [..., T, rd/2]
    cos = jnp.cos(angles) * scaling
    sin = jnp.sin(angles) * scaling
    cos = jnp.concatenate([cos, cos], axis=-1)[..., None, :].astype(x.dtype)
    sin = jnp.concatenate([sin, sin], axis=-1)[..., None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
