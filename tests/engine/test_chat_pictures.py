"""LLM.chat's picture parts (qnext/chat_pictures.py), without an engine: each kind of part becomes the template's
`{"type": "image"}` / `{"type": "video"}` in place, its picture goes to multi_modal_data in prompt order, messages
without pictures pass as they are, and a bad part is a ValueError naming it."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from qnext.chat_pictures import take_pictures
from qnext.engine.visual_encoder import VisionSetup
from qnext.vision.preprocess_config import DEFAULT_IMAGE_CONFIG, DEFAULT_VIDEO_CONFIG
from tests.support.vision_checkpoint import data_url, picture, png_base64

SETUP = VisionSetup(config=None, token_ids=None, image_preprocess=DEFAULT_IMAGE_CONFIG,
                    video_preprocess=DEFAULT_VIDEO_CONFIG, params=None)


def test_parts_become_placeholders_and_pictures_in_order():
    a, b, c = picture(1), picture(2, 16, 8), picture(3)
    frames = "data:video/png;base64," + png_base64(picture(4)) + "," + png_base64(picture(5))
    text_only = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(a)}}, {"type": "text", "text": "and"},
        {"type": "image", "image": np.asarray(b)}, {"type": "video_url", "video_url": {"url": frames}},
        {"type": "image_pil", "image_pil": c}]}
    messages, data = take_pictures([text_only, user], SETUP)
    assert messages[0] is text_only and user["content"][0]["type"] == "image_url"     # the caller's are untouched
    assert [p["type"] for p in messages[1]["content"]] == ["image", "text", "image", "video", "image"]
    assert [np.asarray(im).tolist() for im in data["image"]] == [np.asarray(x).tolist() for x in (a, b, c)]
    (video_frames, fps), = data["video"]
    assert fps == DEFAULT_VIDEO_CONFIG.fps and [np.asarray(f).tolist() for f in video_frames] == \
        [np.asarray(picture(s)).tolist() for s in (4, 5)]
    assert take_pictures([text_only], SETUP) == ([text_only], None)


@pytest.mark.parametrize("part,says", [
    ({"type": "image", "image": np.zeros((4, 4, 3), np.float32)}, r"messages\.0\.content\.0\.image must be a uint8"),
    ({"type": "image", "image": "cat.png"}, r"messages\.0\.content\.0\.image must be a PIL image"),
    ({"type": "video", "video": [Image.new("RGB", (8, 8))]}, r"messages\.0\.content\.0\.video must be \(frames, fps\)"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "could not be decoded"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "does not fetch https URLs"),
])
def test_a_bad_part_is_a_value_error_naming_it(part, says):
    with pytest.raises(ValueError, match=says):
        take_pictures([{"role": "user", "content": [part]}], SETUP)
