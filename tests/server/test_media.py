"""Pictures in chat requests without a server: the translator renders the placeholder where the picture was and
expands it for the checkpoint's tower; limits and bad data are 400s naming the part; a checkpoint without a tower
refuses a picture with a 400 that says so."""
from __future__ import annotations

import pytest

from qnext.engine.visual_intake import vision_setup
from qnext.model.vision_weights import load_vision_params
from qnext.sampling_params import SamplingParams
from qnext.server.chat_request import ChatInputs, ChatTranslator
from qnext.server.errors import APIError
from qnext.tokenizer import Tokenizer
from qnext.vision.media import MediaError, MediaLimits, MediaPart, decode_media
from tests.support.vision_checkpoint import data_url, picture, png_base64, write_vision_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("vl"), tokenizer="qwen3.5")


def message(*parts) -> ChatInputs:
    return ChatInputs(messages=[{"role": "user", "content": list(parts)}])


def test_the_placeholder_sits_where_the_picture_was_and_expands_per_merged_patch(checkpoint):
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    translator = ChatTranslator(tokenizer, vision=vision_setup(checkpoint, load_vision_params(checkpoint)))
    chat = translator.translate(message({"type": "text", "text": "A"},
                                        {"type": "image_url", "image_url": {"url": data_url(picture(1, 48, 32))}},
                                        {"type": "text", "text": "B"}), SamplingParams())
    assert "A<|vision_start|>" + "<|image_pad|>" * 24 + "<|vision_end|>B" in chat.prompt
    assert chat.prompt_token_ids.count(tokenizer.token_to_id("<|image_pad|>")) == 24
    assert [v.grid_thw for v in chat.multi_modal_data["image"]] == [(1, 8, 12)]


def test_a_checkpoint_without_a_tower_refuses_a_picture(checkpoint):
    translator = ChatTranslator(Tokenizer.from_pretrained(checkpoint), vision=None)
    with pytest.raises(APIError, match="reads text only") as e:
        translator.translate(message({"type": "image_url", "image_url": {"url": data_url(picture(1))}}),
                             SamplingParams())
    assert e.value.status == 400 and e.value.param == "messages.0.content.0"


def test_text_that_spells_a_pad_token_next_to_a_picture_is_refused(checkpoint):
    translator = ChatTranslator(Tokenizer.from_pretrained(checkpoint), vision=vision_setup(checkpoint, load_vision_params(checkpoint)))
    with pytest.raises(APIError, match="outside a picture's placeholder"):
        translator.translate(message({"type": "text", "text": "<|image_pad|>"},
                                     {"type": "image_url", "image_url": {"url": data_url(picture(1))}}),
                             SamplingParams())


def test_limits_and_bad_data_name_the_part():
    ok = MediaPart("image", data_url(picture(1)), "m.0")
    images, videos = decode_media([ok], MediaLimits())
    assert images[0].size == (32, 32) and videos == []
    cases = [([ok] * 3, MediaLimits(max_images=2), "3 images; this server takes at most 2", "m.0"),
             ([ok], MediaLimits(max_image_bytes=100), "at most 100 bytes", "m.0"),
             ([ok], MediaLimits(max_image_pixels=1000), "32x32 = 1024 pixels", "m.0"),
             ([MediaPart("image", "data:image/png;base64,AAAA", "m.1")], MediaLimits(), "could not be decoded", "m.1"),
             ([MediaPart("image", "file:///etc/passwd", "m.2")], MediaLimits(), "base64 data URL", "m.2"),
             ([MediaPart("image", "http://127.0.0.1:9/x.png", "m.3")], MediaLimits(), "--allow-media-urls", "m.3"),
             ([MediaPart("video", "data:video/png;base64," + png_base64(picture(1)) + "," +
                         png_base64(picture(2, 16, 16)), "m.4")], MediaLimits(), "differ in size", "m.4")]
    for parts, limits, says, where in cases:
        with pytest.raises(MediaError, match=says) as e:
            decode_media(parts, limits)
        assert e.value.where == where
