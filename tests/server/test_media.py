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


def test_the_request_pixel_budget_is_checked_from_the_headers_before_decoding(monkeypatch):
    from PIL import ImageFile

    def no_decoding(self):
        raise AssertionError("a picture was decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    parts = [MediaPart("image", data_url(picture(i)), f"m.{i}") for i in range(3)]      # 3 x 1024 pixels
    with pytest.raises(MediaError, match=r"m.2: the request's pictures decode to more than 3000 pixels .*3072 so "
                                         r"far.*\(--max-request-pixels\)") as e:
        decode_media(parts, MediaLimits(max_request_pixels=3000))
    assert e.value.where == "m.2"
    frames = MediaPart("video", "data:video/png;base64," + ",".join(png_base64(picture(i)) for i in range(3)), "m.3")
    with pytest.raises(MediaError, match=r"m.3 frame 2: the request's pictures decode to more than 3000"):
        decode_media([frames], MediaLimits(max_request_pixels=3000))


def test_the_servers_per_picture_limit_caps_the_decoder_too(monkeypatch, checkpoint):
    from PIL import Image

    from qnext.server.pictures import PictureInputs

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)       # restored after the test
    PictureInputs(None, MediaLimits(max_image_pixels=5000))
    assert Image.MAX_IMAGE_PIXELS == 5000


def test_a_prompt_whose_pictures_cannot_fit_is_refused_before_they_are_decoded(checkpoint, monkeypatch):
    import qnext.server.pictures as pictures

    tokenizer = Tokenizer.from_pretrained(checkpoint)
    vision = vision_setup(checkpoint, load_vision_params(checkpoint))
    image = {"type": "image_url", "image_url": {"url": data_url(picture(1, 48, 32))}}      # 24 pads
    fits = ChatTranslator(tokenizer, vision=vision, max_model_len=200).translate(message(image), SamplingParams())
    n = len(fits.prompt_token_ids)

    def fail(*args, **kwargs):
        raise AssertionError("the pictures were preprocessed")
    monkeypatch.setattr(pictures, "preprocess_image", fail)
    monkeypatch.setattr(pictures.OpenedMedia, "decode", fail)
    with pytest.raises(APIError, match=rf"the prompt has at least {n} tokens with its pictures \(24 of them for 1 "
                                       rf"pictures\), which leaves no room for output in max_model_len {n}") as e:
        ChatTranslator(tokenizer, vision=vision, max_model_len=n).translate(message(image), SamplingParams())
    assert e.value.status == 400


def test_chats_with_pictures_run_on_a_media_pool_that_cannot_starve_text(monkeypatch):
    import asyncio
    import threading
    import types

    from qnext.served_engine import ServedModel
    from qnext.server.admission import Admission

    model = ServedModel(None, max_model_len=100, vocab_size=9, block_size=16, num_blocks=10)
    admission = Admission(types.SimpleNamespace(served_model=model), "m", media_limits=MediaLimits(workers=1))
    release, threads = threading.Event(), []

    def translate(inputs, params):
        picture_chat = isinstance(inputs.messages[0]["content"], list)
        threads.append((picture_chat, threading.current_thread().name.startswith("qnext-media")))
        if picture_chat:
            assert release.wait(30)
        return "translated"
    monkeypatch.setattr(admission.translator, "translate", translate)
    with_picture = message({"type": "image_url", "image_url": {"url": data_url(picture(1))}})
    text = ChatInputs(messages=[{"role": "user", "content": "hi"}])

    async def run():
        blocked = [asyncio.create_task(admission.chat(with_picture, SamplingParams())) for _ in range(3)]
        assert await asyncio.wait_for(admission.chat(text, SamplingParams()), 10) == "translated"
        release.set()
        assert await asyncio.gather(*blocked) == ["translated"] * 3
    asyncio.run(run())
    assert sorted(threads) == [(False, False), (True, True), (True, True), (True, True)]
    admission.media_pool.shutdown()


def test_the_media_flags_make_the_limits_and_a_bad_one_is_refused_before_loading(tmp_path, caplog):
    from qnext.server.cli import build_parser, main
    from qnext.server.media_flags import media_limits

    parse = build_parser()[0].parse_args
    limits = media_limits(parse(["serve", "--max-request-pixels", "1000", "--media-workers", "2", "--allow-media-urls",
                                 "--media-fetch-timeout", "2.5", "--media-url-allow", "10.1.0.0/16",
                                 "--media-url-allow", "pics.internal"]))
    assert (limits.max_request_pixels, limits.workers, limits.allow_urls, limits.fetch_timeout_s, limits.url_allow) \
        == (1000, 2, True, 2.5, ("10.1.0.0/16", "pics.internal"))
    defaults = media_limits(parse(["serve"]))
    assert (defaults.allow_urls, defaults.url_allow, defaults.fetch_timeout_s) == (False, (), 10.0)
    with pytest.raises(ValueError, match="--media-workers must be positive, got 0"):
        media_limits(parse(["serve", "--media-workers", "0"]))
    # refused before the checkpoint is read (this directory holds none): the error names the flag's entry
    assert main(["serve", str(tmp_path), "--media-url-allow", "http://x"]) == 2
    assert "--media-url-allow entry 'http://x' is neither a host name nor an IP network" in caplog.text
