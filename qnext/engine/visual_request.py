"""A request's images and videos as the engine keeps them with its Sequence: the preprocessed inputs, where their
placeholder tokens lie in the prompt, and the prompt's 3-D MRoPE positions with the position delta that every
token after the prompt carries (qnext/vision/mrope.py).

A prompt names each picture once, as the chat template renders it: `<|vision_start|><|image_pad|><|vision_end|>`
(a video: `<|video_pad|>`). `expand_placeholders` turns each into one pad per merged patch, as transformers'
processor does (a video: per frame group, `<t seconds>` then its own vision_start / pads / vision_end), before the
text is tokenized. The cache keys every block holding pads on the picture's content hash (cache/image_keys.py).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from cache.image_keys import ImageSpan
from qnext.vision.config import VisionTokenIds
from qnext.vision.mrope import mrope_positions, position_delta, text_positions
from qnext.vision.preprocess import VisualInput

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
_PLACEHOLDER = re.compile(re.escape(VISION_START) + "(" + re.escape(IMAGE_PAD) + "|" + re.escape(VIDEO_PAD) + ")"
                          + re.escape(VISION_END))


@dataclasses.dataclass(frozen=True)
class VisualRun:
    """One run of pad tokens: an image, or one frame group of a video."""
    start: int             # first pad's position in the prompt
    length: int
    input_index: int       # which of the request's visual inputs
    embed_offset: int      # the run's first row in that input's tower output


@dataclasses.dataclass(eq=False)
class SequenceVisuals:
    inputs: tuple[VisualInput, ...]      # in prompt order
    runs: tuple[VisualRun, ...]
    positions: np.ndarray                # [3, prompt_len] int32 MRoPE positions of the prompt
    delta: int                           # a token at index i past the prompt has position i + delta (all axes)

    @property
    def spans(self) -> tuple[ImageSpan, ...]:
        """What the prefix cache keys the runs' blocks on: each run with its input's full SHA-256."""
        return tuple(ImageSpan(r.start, r.length, bytes.fromhex(self.inputs[r.input_index].content_hash))
                     for r in self.runs)

    def as_data(self) -> dict:
        """The inputs as a prompt dict's `multi_modal_data` (preprocessed: intake takes them as they are)."""
        return {kind: [v for v in self.inputs if v.kind == kind] for kind in ("image", "video")}

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] positions of tokens [start, end): the prompt's own, then text past it."""
        prompt_len = self.positions.shape[1]
        head = self.positions[:, start:min(end, prompt_len)]
        if end <= prompt_len:
            return head
        lo = max(start, prompt_len)
        return np.concatenate([head, text_positions(lo, end - lo, self.delta)], axis=1)


def sequence_visuals(token_ids: Sequence[int], inputs: Sequence[VisualInput], ids: VisionTokenIds,
                     spatial_merge_size: int) -> SequenceVisuals:
    """The prompt's visual runs matched to its inputs (in prompt order): ValueError when the pads do not match."""
    inputs = tuple(inputs)
    positions = mrope_positions(token_ids, [v.grid_thw for v in inputs], ids.image_token_id, ids.video_token_id,
                                spatial_merge_size)   # checks every run against its input's grid
    pad_ids = np.asarray(token_ids)
    is_pad = (pad_ids == ids.image_token_id) | (pad_ids == ids.video_token_id)
    frames = [(i, f * v.tokens_per_frame, ids.image_token_id if v.kind == "image" else ids.video_token_id)
              for i, v in enumerate(inputs) for f in range(v.grid_thw[0])]
    runs = []
    for start in np.flatnonzero(is_pad & ~np.concatenate([[False], is_pad[:-1]])).tolist():
        end = start
        while end < len(pad_ids) and pad_ids[end] == pad_ids[start]:
            end += 1
        index, offset, pad = frames[len(runs)]
        if pad_ids[start] != pad:
            raise ValueError(f"the pad tokens at position {start} are {'video' if pad == ids.image_token_id else 'image'} "
                             f"pads, but visual input {index} is {'an image' if pad == ids.image_token_id else 'a video'}")
        runs.append(VisualRun(start, end - start, index, offset))
    return SequenceVisuals(inputs, tuple(runs), positions, position_delta(positions))


def expand_placeholders(text: str, images: Sequence[VisualInput] = (), videos: Sequence[VisualInput] = ()
                        ) -> tuple[str, list[VisualInput]]:
    """(the text with every picture's placeholder expanded to its pads, the inputs in prompt order). The i-th image
    placeholder takes images[i], the i-th video placeholder videos[i]; ValueError when the counts differ."""
    images, videos = list(images), list(videos)
    found = [m.group(1) for m in _PLACEHOLDER.finditer(text)]
    wanted = (found.count(IMAGE_PAD), found.count(VIDEO_PAD))
    if wanted != (len(images), len(videos)):
        raise ValueError(f"the prompt has {wanted[0]} image and {wanted[1]} video placeholders "
                         f"({VISION_START}{IMAGE_PAD}{VISION_END}, ...{VIDEO_PAD}...) but {len(images)} images and "
                         f"{len(videos)} videos were given")
    if text.count(IMAGE_PAD) != wanted[0] or text.count(VIDEO_PAD) != wanted[1]:
        raise ValueError(f"the prompt text holds {IMAGE_PAD} or {VIDEO_PAD} outside a picture's placeholder; "
                         "remove it from the text")
    order: list[VisualInput] = []

    def expand(match: re.Match) -> str:
        item = images.pop(0) if match.group(1) == IMAGE_PAD else videos.pop(0)
        order.append(item)
        if item.kind == "image":
            return VISION_START + IMAGE_PAD * item.num_tokens + VISION_END
        return "".join(f"<{t:.1f} seconds>" + VISION_START + VIDEO_PAD * item.tokens_per_frame + VISION_END
                       for t in item.timestamps)

    return _PLACEHOLDER.sub(expand, text), order
