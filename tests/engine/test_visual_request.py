"""A prompt's pictures as the engine keeps them: placeholders expanded per merged patch (a video per frame group,
with its timestamps), pad runs matched to their inputs in prompt order, and positions past the prompt carrying the
delta."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from qnext.engine.visual_request import expand_placeholders, sequence_visuals
from qnext.vision.config import VisionTokenIds
from qnext.vision.preprocess import VisualInput

IDS = VisionTokenIds(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
IMG, VID = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"


def visual(kind: str, grid, name: str, timestamps=()) -> VisualInput:
    t, h, w = grid
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:6], 16)       # pixels of its own per name
    return VisualInput(kind, np.full((t * h * w, 1), seed, np.float32), grid, t * h * w // 4, tuple(timestamps))


def test_placeholders_expand_in_order_and_videos_per_frame_group():
    image, video = visual("image", (1, 4, 6), "a"), visual("video", (2, 4, 4), "v", (0.25, 1.25))
    text, order = expand_placeholders(f"A{VID}B{IMG}C", [image], [video])
    assert order == [video, image]
    frame = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
    assert text == f"A<0.2 seconds>{frame}<1.2 seconds>{frame}B<|vision_start|>{'<|image_pad|>' * 6}<|vision_end|>C"
    with pytest.raises(ValueError, match="1 image and 0 video placeholders .* but 2 images"):
        expand_placeholders(f"A{IMG}", [image, image])


def test_runs_match_inputs_and_positions_continue_past_the_prompt_with_the_delta():
    image, video = visual("image", (1, 4, 6), "a"), visual("video", (2, 4, 4), "v", (0.0, 1.0))
    ids = [1, 502] + [501] * 4 + [503, 2, 502] + [501] * 4 + [503, 3, 502] + [500] * 6 + [503, 4]
    visuals = sequence_visuals(ids, [video, image], IDS, spatial_merge_size=2)
    assert [(r.start, r.length, r.input_index, r.embed_offset) for r in visuals.runs] == \
        [(2, 4, 0, 0), (9, 4, 0, 4), (16, 6, 1, 0)]
    assert [s.content_hash for s in visuals.spans] == [bytes.fromhex(video.content_hash)] * 2 + \
        [bytes.fromhex(image.content_hash)]
    n = len(ids)
    after = visuals.rope_positions(n - 1, n + 2)        # the last prompt token, then two decoded ones
    assert (after[:, 1:] == np.arange(n, n + 2) + visuals.delta).all() and visuals.delta < 0
    assert (after[:, 0] == visuals.positions[:, -1]).all() and after[0, 1] == visuals.positions[0, -1] + 1
    with pytest.raises(ValueError):
        sequence_visuals(ids, [image, video], IDS, spatial_merge_size=2)     # inputs out of order
