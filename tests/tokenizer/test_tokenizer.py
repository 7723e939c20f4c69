import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qnext.sampling_params import SamplingParams
from qnext.testing.tiny_tokenizer import (_CORPUS, TINY_EOS_TOKEN, tiny_eos_token_id, tiny_special_token_ids,
                                          tiny_vision_token_ids, write_tiny_tokenizer)
from qnext.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string, partial_stop_length

MULTIBYTE = "Hello 世界! The weather is 晴れ today 🙂👍🏽 — naïve café, over the lazy dog."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer.from_pretrained(tiny_dir)


def test_tiny_tokenizer_is_deterministic_with_fixed_special_ids(tiny_dir, tmp_path, tok):
    write_tiny_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes()
    assert tok.vocab_size == 512
    ids = tiny_special_token_ids(512)
    assert list(ids.values()) == list(range(507, 512))
    assert all(tok.token_to_id(name) == i for name, i in ids.items())
    assert tok.eos_token == TINY_EOS_TOKEN and tok.eos_token_id == tiny_eos_token_id(512) == 509
    assert tok.eos_token_ids == (509,) and tok.pad_token_id == 507
    assert tok.all_special_ids == {507, 508, 509}


@pytest.fixture(scope="module")
def vision_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_vision_tokenizer")
    write_tiny_tokenizer(path, vision=True)
    return Tokenizer.from_pretrained(path)


def test_vision_tokenizer_adds_the_vision_tokens_before_the_chat_tokens(vision_tok, tok):
    ids = tiny_special_token_ids(512, vision=True)
    assert list(ids.values()) == list(range(503, 512)) and all(vision_tok.token_to_id(n) == i for n, i in ids.items())
    assert vision_tok.all_special_ids == {503, 504, 505, 506, 507, 508, 509} and vision_tok.eos_token_id == 509
    assert tiny_vision_token_ids(512) == {"image_token_id": 505, "video_token_id": 506, "vision_start_token_id": 503,
                                          "vision_end_token_id": 504}
    english = "The people of the village worked in the fields and told stories by the fire at night."
    assert vision_tok.encode(english) == tok.encode(english)     # four merges fewer: common text is unchanged


def test_only_a_placeholder_spelled_out_encodes_to_vision_tokens(vision_tok):
    """Ordinary text (the training corpus, multibyte text, near-misses of the names) never produces a vision
    token; the placeholder the chat template writes is exactly three tokens, and decoding skips them."""
    vision = set(tiny_vision_token_ids(512).values())
    for text in (_CORPUS, MULTIBYTE, "<|vision_start| <|image_pad> |video_pad|> vision_end image_pad"):
        assert not vision & set(vision_tok.encode(text))
    ids = vision_tok.encode("see <|vision_start|><|image_pad|><|vision_end|> here")
    assert ids[-5:-2] == [503, 505, 504] and vision_tok.decode(ids) == "see  here"


def test_chat_template_renders_pictures_like_qwen35(tok):
    parts = [{"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": "data:,"}},
             {"type": "text", "text": " with "}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "."}]
    prompt = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=False)
    pic = "<|vision_start|>{}<|vision_end|>"
    assert prompt == ("<|im_start|>user\nCompare " + pic.format("<|image_pad|>") + " with "
                      + pic.format("<|image_pad|>") + pic.format("<|video_pad|>") + ".<|im_end|>\n")
    with pytest.raises(Exception, match="Unexpected item type"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}])


def test_tiny_tokenizer_other_vocab_size(tmp_path):
    write_tiny_tokenizer(tmp_path, vocab_size=1024)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == 1024 and tok.eos_token_id == tiny_eos_token_id(1024) == 1021
    with pytest.raises(ValueError, match="vocab_size must be >= 261"):
        write_tiny_tokenizer(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size must be >= 265"):
        write_tiny_tokenizer(tmp_path, vocab_size=263, vision=True)


def test_round_trip_and_compact_english(tok):
    assert tok.decode(tok.encode(MULTIBYTE)) == MULTIBYTE
    english = "The people of the village worked in the fields and told stories by the fire at night."
    assert len(tok.encode(english)) <= len(english) // 2


def test_decode_skips_special_tokens_but_not_think(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHi<|im_end|>")
    assert 508 in ids and 509 in ids and 510 in ids
    assert tok.decode(ids) == "assistant\n<think>\nhmm\n</think>\n\nHi"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>assistant")


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "text", "text": "Name a "},
                                             {"type": "text", "text": "fox"}]}]
    text = tok.apply_chat_template(messages)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a fox<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, tokenize=True) == tok.encode(text, add_special_tokens=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == text.removesuffix(
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages[:1], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(jinja2.TemplateError, match="unsupported role function"):
        tok.apply_chat_template([{"role": "function", "content": "x"}])
    with pytest.raises(jinja2.TemplateError, match="needs a user query"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_file_and_generation_config(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}{% endfor %}{{ eos_token }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [509, 507]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "héllo"}]) == '[user]"héllo"<|im_end|>'
    assert tok.eos_token_ids == (509, 507)


def test_missing_tokenizer_json_names_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in {tmp_path}"):
        Tokenizer.from_pretrained(tmp_path)


def stream(tok, ids, params, step=1):
    detok = IncrementalDetokenizer(tok, params)
    deltas, stop = [], None
    for i in range(0, len(ids), step):
        stop = detok.update(ids[i:i + step])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    if stop is None:
        detok.update([], finished=True)
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


def test_incremental_detokenizer_never_splits_a_character(tok):
    ids = tok.encode(MULTIBYTE)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens hold part of a character
    for step in (1, 2, 3):
        detok, deltas, stop = stream(tok, ids, SamplingParams(), step)
        assert stop is None and "".join(deltas) == detok.output_text == MULTIBYTE
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("Hi<|im_end|>") + tok.encode(" there")
    detok, deltas, _ = stream(tok, ids, SamplingParams())
    assert "".join(deltas) == "Hi there"
    detok, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "Hi<|im_end|> there"


def test_find_stop_string_and_partial_match():
    assert find_stop_string("abc STOP def END", ["END", "STOP"]) == (4, "STOP")
    assert find_stop_string("xxab", ["ab", "a"]) == (2, "ab")
    assert find_stop_string("STOP here", ["STOP"], search_from=1) is None
    assert partial_stop_length("hello wor", ["world", "or"]) == 3
    assert partial_stop_length("hello", ["world"]) == 0
    assert partial_stop_length("hello w", ["world", "x"]) == 1


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_stream_and_holds_back_partial_match(tok, include):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    params = SamplingParams(stop=["lazy", "fox jumps"], include_stop_str_in_output=include)
    detok, deltas, stop = stream(tok, ids, params)
    want = "The quick brown fox jumps" if include else "The quick brown "
    assert stop == "fox jumps" and detok.stop_reason == "fox jumps"
    assert detok.output_text == want and "".join(deltas) == want
    if not include:
        # "fox" was held back while it could still become "fox jumps", so no delta ever showed it.
        assert not any("fox" in d for d in deltas)
    detok.update(tok.encode(" more"))
    assert detok.output_text == want


def test_held_back_partial_stop_is_released_at_finish(tok):
    detok, deltas, stop = stream(tok, tok.encode("over the laz"), SamplingParams(stop=["lazy"]))
    assert stop is None and "".join(deltas) == "over the laz"
    assert "laz" not in "".join(deltas[:-1])


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_dropped_unless_included(tok, include):
    ids = tok.encode("Hi there<|im_end|>")
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, params)
    detok.update(ids[:-1])
    assert detok.update(ids[-1:], stop_token_terminated=True) is None
    assert detok.get_next_output_text(finished=True, delta=False) == "Hi there" + "<|im_end|>" * include


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("stop here, then stop again")
    detok, deltas, stop = stream(tok, ids, SamplingParams(stop=["stop"], min_tokens=3))
    assert stop == "stop" and detok.output_text == "stop here, then "


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab xé世🙂\n", max_size=40), stop=st.text(alphabet="ab é🙂", min_size=1, max_size=3),
       step=st.integers(1, 4), include=st.booleans())
def test_streamed_text_equals_truncated_full_text(tok, text, stop, step, include):
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok, deltas, matched = stream(tok, tok.encode(text), params, step)
    index = text.find(stop)
    want = text if index < 0 else text[:index + len(stop) * include]
    assert matched == (stop if index >= 0 else None)
    assert "".join(deltas) == detok.output_text == want
