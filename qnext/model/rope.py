"""RoPE inverse frequencies for the partial rotary slice (first `rotary_dim` dims of each head).

Matches transformers' `ROPE_INIT_FUNCTIONS` ("linear", "yarn") and the models' default init, in float32.
The rotation itself is NeoX style (pairs i, i + rotary_dim/2); cos/sin are multiplied by `attention_scaling`.
"""

from __future__ import annotations

import math

import numpy as np

from qnext.config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [rotary_dim/2] float32, attention_scaling)."""
    dim = cfg.rotary_dim
    base = cfg.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # base ** e correctly rounded to float32 (as torch's pow; numpy's float32 pow is off by one ulp at some e).
    # One ulp of inv_freq moves the angle at position 2^20 by ~0.03 rad, so the tables must agree bit for bit.
    pos_freqs = np.power(np.float64(base), exponents.astype(np.float64)).astype(np.float32)  # [dim/2]
    scaling = cfg.rope_scaling
    if scaling is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    if scaling.rope_type == "linear":
        return (np.float32(1.0) / pos_freqs / np.float32(scaling.factor)).astype(np.float32), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(cfg, dim, base, pos_freqs)
    raise ValueError(f"rope_type {scaling.rope_type!r} is not supported; expected default, linear or yarn")


def _yarn(cfg: ModelConfig, dim: int, base: float, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
    s = cfg.rope_scaling
    original = s.original_max_position_embeddings or cfg.max_position_embeddings
    factor = s.factor if s.factor is not None else cfg.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp, as HF does
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = np.float32(1) - ramp.astype(np.float32)
    inv_extrapolation = np.float32(1.0) / pos_freqs
    inv_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation_factor) + inv_extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def position_limit(cfg: ModelConfig) -> int:
    """The positions the RoPE configuration covers: max_position_embeddings, or with YaRN factor x the original
    length when that is larger (the release's factor 4 over 262,144 gives 1,048,576)."""
    s = cfg.rope_scaling
    if s is None or s.rope_type != "yarn":
        return cfg.max_position_embeddings
    original = s.original_max_position_embeddings or cfg.max_position_embeddings
    factor = s.factor if s.factor is not None else cfg.max_position_embeddings / original
    return max(cfg.max_position_embeddings, int(factor * original))


def position_limit_error(cfg: ModelConfig, num_positions: int, what: str) -> ValueError:
    """The refusal for `what` needing `num_positions` positions beyond position_limit(cfg), naming the options."""
    limit, native = position_limit(cfg), cfg.max_position_embeddings
    factor = -(-num_positions // native)
    return ValueError(
        f"{what} needs {num_positions} positions; the model's RoPE covers {limit} (max_position_embeddings "
        f"{native}{', with YaRN' if limit != native else ''}). Lower max_model_len, or extend the positions with "
        f"YaRN in the checkpoint's config.json: \"rope_parameters\": {{\"rope_type\": \"yarn\", \"factor\": "
        f"{float(max(factor, 2))}, \"original_max_position_embeddings\": {native}, ...}}")
