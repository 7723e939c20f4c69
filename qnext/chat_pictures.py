"""Pictures in LLM.chat's messages: each picture part is taken out of its message (data URLs decoded as the server
decodes them, qnext/vision/media.py) and replaced by the part that Qwen3.5's chat template renders as the picture's
placeholder, `{"type": "image"}` -> `<|vision_start|><|image_pad|><|vision_end|>` (a video: `<|video_pad|>`).

Picture parts of a content list (user and tool messages):

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}     OpenAI's, as the server takes it
    {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,<frame>,<frame>,..."}}   vLLM's frames
    {"type": "image_pil", "image_pil": PIL.Image}                                vLLM's
    {"type": "image", "image": PIL.Image | uint8 array [H, W] or [H, W, 3 | 4] | VisualInput}
    {"type": "video", "video": (frames, fps) | VisualInput}      frames: PIL images or uint8 arrays, one size

Frames of a `video_url` are read as sampled at the video preprocessing's fps, as the server reads them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from qnext.engine.visual_encoder import VisionSetup
from qnext.engine.visual_intake import NO_TOWER
from qnext.vision.media import MediaLimits, decode_media, openai_part_media
from qnext.vision.preprocess import VisualInput


def take_pictures(messages: list[dict[str, Any]], vision: VisionSetup | None,
                  limits: MediaLimits = MediaLimits()) -> tuple[list[dict[str, Any]], dict | None]:
    """(the messages for the chat template, multi_modal_data: {"image": [...], "video": [...]} in prompt order per
    kind, or None when no message holds a picture). Messages without pictures are passed on as they are.
    ValueError naming the part ("messages.0.content.1") on a malformed or undecodable picture."""
    images: list = []
    videos: list = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts, found = [], False
        for j, part in enumerate(content):
            picture = _picture(part, f"messages.{i}.content.{j}", vision, limits) if isinstance(part, dict) else None
            if picture is None:
                parts.append(part)
                continue
            kind, value = picture
            (images if kind == "image" else videos).append(value)
            parts.append({"type": kind})
            found = True
        out.append(dict(message, content=parts) if found else message)
    if not images and not videos:
        return list(messages), None
    return out, {"image": images, "video": videos}


def _picture(part: dict, where: str, vision: VisionSetup | None, limits: MediaLimits) -> tuple[str, Any] | None:
    """("image" | "video", what visual_prompt takes) for a picture part, None for any other part."""
    kind = part.get("type")
    media = openai_part_media(part, where)
    if media is None and kind not in ("image", "image_pil", "video"):
        return None
    if vision is None:
        raise ValueError(f"{where}: {NO_TOWER}")
    if media is not None:
        images, videos = decode_media([media], limits)
        return ("image", images[0]) if images else ("video", (videos[0], vision.video_preprocess.fps))
    value = part.get(kind)
    if kind == "video":
        if isinstance(value, VisualInput):
            return "video", value
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float))):
            raise ValueError(f"{where}.video must be (frames, fps) or a preprocessed VisualInput, got "
                             f"{type(value).__name__}")
        return "video", ([_image(f, f"{where}.video frame {k}") for k, f in enumerate(value[0])], value[1])
    if isinstance(value, VisualInput):
        return "image", value
    return "image", _image(value, f"{where}.{kind}")


def _image(value: Any, where: str) -> Image.Image:
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or not (value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (3, 4))):
            raise ValueError(f"{where} must be a uint8 array of shape [H, W], [H, W, 3] or [H, W, 4]; got "
                             f"{value.dtype} {list(value.shape)}")
        return Image.fromarray(value)
    raise ValueError(f"{where} must be a PIL image, a uint8 numpy array or a preprocessed VisualInput, got "
                     f"{type(value).__name__}")
