"""Pictures through the official openai and anthropic SDKs (chat completions, Anthropic Messages, Responses),
streamed and not, against one `qnext serve` of a tiny Qwen3.5 vision-language checkpoint with the real tokenizer:
a picture is read (its pad tokens count in the prompt), the same picture again is served from the prefix cache,
an Anthropic image inside a tool_result reaches the tower, a video as frames runs; a URL (fetching is off), bytes
that are no image, too many images and too many pixels are 400s that say which, and the server keeps serving."""
from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from qnext.server.launch import running_server
from tests.support.vision_checkpoint import data_url, picture, png_base64, write_vision_checkpoint

MODEL = "qwen35-vl-tiny"
SERVER_ARGS = ["--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "2",
               "--max-num-batched-tokens", "256", "--no-warm-up", "--log-level", "warning",
               "--limit-mm-per-prompt", '{"image": 3, "video": 1}', "--max-image-pixels", "10000"]
TOKENS_PER_PICTURE = 16            # a 32x32 picture: 8x8 patches of 4 pixels, merged 2x2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = write_vision_checkpoint(tmp_path_factory.mktemp("qwen35vl") / "ckpt", seed=0, tokenizer="qwen3.5",
                                         max_position_embeddings=1024)
    with running_server([str(checkpoint), *SERVER_ARGS], timeout=300,
                        log_path=tmp_path_factory.mktemp("server") / "server.log",
                        env={"JAX_PLATFORMS": "cpu"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0) as c:
        yield c


def image_message(seed: int, text: str = "What is in this picture?") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture(seed))}},
                                        {"type": "text", "text": text}]}


def tower_runs(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return float(re.search(r"^qnext:vision_tower_runs_total\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_chat_reads_a_picture_and_the_same_picture_hits_the_cache(oai, server):
    text_only = oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "What is in this picture?"}])
    first = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[image_message(1)])
    # the placeholder: <|vision_start|> + 16 pads + <|vision_end|>
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + TOKENS_PER_PICTURE + 2
    runs = tower_runs(server)
    again = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[image_message(1)])
    assert again.usage.prompt_tokens_details.cached_tokens >= TOKENS_PER_PICTURE
    assert again.choices[0].message.content == first.choices[0].message.content
    assert runs >= 1 and tower_runs(server) == runs          # the picture is not encoded again


def test_chat_streamed_with_two_pictures(oai):
    message = image_message(2)
    message["content"].insert(1, {"type": "image_url", "image_url": {"url": data_url(picture(3), "JPEG")}})
    chunks = list(oai.chat.completions.create(model=MODEL, max_tokens=5, messages=[message], stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_video_as_frames(oai):
    frames = [png_base64(picture(10 + i)) for i in range(4)]
    video = {"type": "video_url", "video_url": {"url": "data:video/png;base64," + ",".join(frames)}}
    reply = oai.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": [video, {"type": "text", "text": "What happens?"}]}])
    assert reply.usage.prompt_tokens > 2 * TOKENS_PER_PICTURE      # two frame groups of 16 pads


def anthropic_image(seed: int) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_base64(picture(seed))}}


def test_anthropic_image_in_a_user_turn_and_in_a_tool_result(claude):
    reply = claude.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [anthropic_image(4), {"type": "text", "text": "Describe it."}]}])
    assert reply.stop_reason == "max_tokens" and reply.usage.input_tokens > TOKENS_PER_PICTURE
    messages = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [anthropic_image(5), {"type": "text", "text": "the screen"}]}]}]
    tools = [{"name": "screenshot", "description": "Takes a screenshot", "input_schema": {"type": "object"}}]
    with claude.messages.stream(model=MODEL, max_tokens=4, messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.usage.input_tokens > TOKENS_PER_PICTURE


def test_responses_input_image_streamed_and_not(oai):
    content = [{"type": "input_text", "text": "What is this?"},
               {"type": "input_image", "image_url": data_url(picture(6))}]
    reply = oai.responses.create(model=MODEL, max_output_tokens=4, input=[{"role": "user", "content": content}])
    assert reply.usage.input_tokens > TOKENS_PER_PICTURE
    events = list(oai.responses.create(model=MODEL, max_output_tokens=4, stream=True,
                                       input=[{"role": "user", "content": content}]))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.input_tokens == reply.usage.input_tokens


@pytest.mark.parametrize("part, says", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "--allow-media-urls"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}, "could not be decoded"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": data_url(picture(7, 120, 100))}}, "at most 10000 pixels"),
])
def test_bad_pictures_are_400s_that_say_which_and_the_server_keeps_serving(oai, part, says):
    with pytest.raises(openai.BadRequestError, match=says.replace("+", r"\+")) as e:
        oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}])
    assert "messages.0.content.1" in str(e.value)
    assert oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[image_message(8)]).choices


def test_too_many_images_is_a_400_on_every_api(oai, claude):
    parts = [{"type": "image_url", "image_url": {"url": data_url(picture(9))}}] * 4
    with pytest.raises(openai.BadRequestError, match="4 images; this server takes at most 3"):
        oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": parts}])
    with pytest.raises(anthropic.BadRequestError, match="at most 3"):
        claude.messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [anthropic_image(9)] * 4}])
    with pytest.raises(openai.BadRequestError, match="at most 3"):
        oai.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(picture(9))}] * 4}])
