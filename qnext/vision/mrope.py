"""Qwen3.5's 3-D positions (interleaved MRoPE) for prompts with images and videos.

Positions (transformers' Qwen3_5Model.get_rope_index): a prompt is cut into runs of text tokens and runs of one
image's or one video frame group's pad tokens. Text at offset `p` counts p, p + 1, ... on all three axes (t, h, w).
A visual run starting at `p` over a grid of llm_h x llm_w merged patches (grid h, w / merge) gets t = p (the frame
group's own time index is 0: Qwen3.5 separates frames by timestamps in the text, so each frame group is its own run),
h = p + row, w = p + column; the text after it continues at p + max(llm_h, llm_w), the run's largest position + 1.
So a sequence's positions run behind its token count: `position_delta` = max position + 1 - length (<= 0), which
decode adds to the token index (all three axes equal again).

Rotary: the rotary dims' rd/2 frequencies are shared out between the axes interleaved: frequency j takes its
angle from h when j % 3 == 1 and j < 3 * section[1], from w when j % 3 == 2 and j < 3 * section[2], else from t
(section [11, 11, 10] over Qwen3.5's 32 frequencies). With equal axes this is the plain partial RoPE.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

DEFAULT_MROPE_SECTION = (11, 11, 10)


def mrope_positions(token_ids: Sequence[int], visual_grids: Sequence[tuple[int, int, int]], image_token_id: int,
                    video_token_id: int, spatial_merge_size: int, start: int = 0) -> np.ndarray:
    """[3, T] int32 positions of a prompt. visual_grids: the (t, h, w) patch grid of each image and video in the
    order they appear in the prompt; a video of t frame groups fills t runs of video pad tokens. start: the
    position of the first token (0 for a prompt). ValueError when the pad runs do not match the grids."""
    ids = np.asarray(token_ids, dtype=np.int64)
    is_pad = (ids == image_token_id) | (ids == video_token_id)
    out = np.empty((3, len(ids)), np.int32)
    frames = [(int(h), int(w)) for t, h, w in visual_grids for _ in range(int(t))]   # one per frame group
    runs = _runs(ids, is_pad)
    pos, used = start, 0
    for lo, hi in runs:
        if not is_pad[lo]:
            out[:, lo:hi] = np.arange(pos, pos + hi - lo)
            pos += hi - lo
            continue
        if used == len(frames):
            raise ValueError(f"the prompt has more image / video pad runs than the {len(visual_grids)} visual "
                             "inputs given")
        h, w = frames[used]
        used += 1
        llm_h, llm_w = h // spatial_merge_size, w // spatial_merge_size
        if hi - lo != llm_h * llm_w:
            raise ValueError(f"a run of {hi - lo} image / video pad tokens at token {lo} does not match its grid "
                             f"({h} x {w} patches = {llm_h * llm_w} tokens); render the prompt from the "
                             "preprocessed inputs' num_tokens")
        rows, cols = np.meshgrid(np.arange(llm_h), np.arange(llm_w), indexing="ij")
        out[0, lo:hi] = pos
        out[1, lo:hi] = pos + rows.reshape(-1)
        out[2, lo:hi] = pos + cols.reshape(-1)
        pos += max(llm_h, llm_w)
    if used != len(frames):
        raise ValueError(f"the prompt has {used} image / video pad runs but the visual inputs have {len(frames)} "
                         "images and video frame groups")
    return out


def position_delta(positions: np.ndarray, start: int = 0) -> int:
    """max position + 1 - (start + number of tokens): what the token index of every later (text) token is
    shifted by. 0 for text only."""
    length = positions.shape[-1]
    return int(positions.max()) + 1 - (start + length) if length else 0


def text_positions(start: int, length: int, delta: int) -> np.ndarray:
    """[3, length] positions of text tokens at token indices start.. after a prompt with `delta`."""
    return np.broadcast_to(np.arange(start, start + length, dtype=np.int32) + delta, (3, length)).copy()


def mrope_axis_of_frequency(num_frequencies: int, mrope_section: Sequence[int]) -> np.ndarray:
    """[rd/2] int: which position axis (0 t, 1 h, 2 w) each rotary frequency takes its angle from."""
    j = np.arange(num_frequencies)
    axis = np.zeros(num_frequencies, np.int32)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axis


def mrope_angles(positions, inv_freq: np.ndarray, mrope_section: Sequence[int]):
    """positions: [3, ..., T] -> angles [..., T, rd/2] float32: frequency j times the position on its axis."""
    axis = mrope_axis_of_frequency(len(inv_freq), mrope_section)
    per_axis = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)        # [3, ..., T, rd/2]
    one_hot = jnp.asarray(np.eye(3, dtype=np.float32)[axis].T)                         # [3, rd/2]
    picked = per_axis * one_hot.reshape((3,) + (1,) * (per_axis.ndim - 2) + (len(inv_freq),))
    return picked.sum(axis=0)


def _runs(ids: np.ndarray, is_pad: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) runs of equal token kind: text, or one id of pad (an image run and a video run never merge)."""
    runs, lo = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or is_pad[i] != is_pad[lo] or (is_pad[i] and ids[i] != ids[lo]):
            runs.append((lo, i))
            lo = i
    return runs
