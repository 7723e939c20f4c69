"""Host-side tables of a patch grid, computed once per static grid (constants under jit): where each patch sits
(merge-block order, as the preprocessing lays patches out), its 2-D RoPE angles, and the bilinear taps into the
square table of learned position embeddings (transformers: `align_corners=True` bilinear resampling)."""
from __future__ import annotations

import numpy as np

from qnext.vision.config import VisionConfig


def patch_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each of a frame's h * w patches, in the order the patches come: merge block by merge block
    (row-major), and inside a block row-major."""
    index = np.arange(h * w)
    in_col, in_row = index % merge, (index // merge) % merge
    block_col = (index // (merge * merge)) % (w // merge)
    block_row = index // (merge * merge * (w // merge))
    return block_row * merge + in_row, block_col * merge + in_col


def rotary_angles(grid: tuple[int, int, int], cfg: VisionConfig) -> np.ndarray:
    """[t * h * w, head_dim / 2] float32: per patch, the row angles then the column angles over head_dim / 4
    frequencies theta^(-4i / head_dim) (cos / sin of these, duplicated, rotate the whole head dim NeoX style)."""
    t, h, w = grid
    half = cfg.head_dim // 2
    inv_freq = np.float32(1.0) / np.power(np.float32(cfg.rope_theta),
                                          np.arange(0, half, 2, dtype=np.float32) / np.float32(half))
    rows, cols = patch_rows_cols(h, w, cfg.spatial_merge_size)
    angles = np.concatenate([rows[:, None].astype(np.float32) * inv_freq, cols[:, None].astype(np.float32) * inv_freq],
                            axis=-1)
    return np.tile(angles.astype(np.float32), (t, 1))


def position_embedding_taps(grid: tuple[int, int, int], cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(indices [t * h * w, 4] int32 into the flattened side x side table, weights [t * h * w, 4] float32)."""
    t, h, w = grid
    side = cfg.position_grid_side
    rows, cols = patch_rows_cols(h, w, cfg.spatial_merge_size)
    row_taps, row_weights = _axis_taps(rows, h, side)
    col_taps, col_weights = _axis_taps(cols, w, side)
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return np.tile(indices.astype(np.int32), (t, 1)), np.tile(weights.astype(np.float32), (t, 1))


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Linear interpolation along one axis, endpoints aligned: target index i of `size` samples reads source
    i * (side - 1) / (size - 1) between its floor and floor + 1 (clamped), in float32 as the reference."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.clip(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)), 0, None)
    return taps, weights.astype(np.float32)
