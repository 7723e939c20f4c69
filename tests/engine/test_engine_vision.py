"""Requests with pictures through the engine: the cache keys on each picture (another picture reuses only the text
before it and answers differently; the same picture reuses the whole prefix and answers as a cold run), the tower
runs once per picture, a growing chat reuses the previous turns, text-only traffic hits as without a tower, and a
picture split over several prefill steps gives the one-step result."""
from __future__ import annotations

import numpy as np
import pytest

import qnext
from qnext import SamplingParams
from qnext.testing.tiny_tokenizer import tiny_vision_token_ids
from qnext.vision.preprocess import VisualInput, preprocess_image
from tests.support.vision_checkpoint import data_url, picture, without_tower, write_vision_checkpoint

BS = 16
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=128, max_model_len=512, block_size=BS,
              num_gpu_blocks_override=64, max_num_snapshots=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
VS, VE, PAD = (tiny_vision_token_ids()[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id"))


def image_prompt(text: list[int], images: list, tail: list[int], tokens_per_image: int = 16) -> dict:
    ids = list(text)
    for _ in images:
        ids += [VS] + [PAD] * tokens_per_image + [VE] + tail
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def logprobs(out) -> np.ndarray:
    return np.array([next(iter(entry.values())).logprob for entry in out.outputs[0].logprobs])


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    vlm = write_vision_checkpoint(tmp_path_factory.mktemp("vlm"), seed=3)
    return vlm, without_tower(vlm, tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def llm(paths):
    return qnext.LLM(paths[0], **ENGINE)


@pytest.fixture(scope="module")
def cold_split_llm(paths):
    """No prefix cache and a 24-token step budget: every prompt cold, every picture split over prefill steps."""
    return qnext.LLM(paths[0], **dict(ENGINE, enable_prefix_caching=False, max_num_batched_tokens=24))


@pytest.fixture(scope="module")
def text_llm(paths):
    text_llm = qnext.LLM(paths[1], **ENGINE)
    assert text_llm.engine.vision is None
    return text_llm


def test_other_picture_reuses_only_the_text_and_answers_differently(llm):
    text = list(range(10, 50))                         # 40 tokens: <|vision_start|> at 40, boundary 32
    first = llm.generate(image_prompt(text, [picture(1)], [60, 61, 62]), GREEDY)[0]
    other = llm.generate(image_prompt(text, [picture(2)], [60, 61, 62]), GREEDY)[0]
    assert other.num_cached_tokens == 32
    assert first.outputs[0].token_ids != other.outputs[0].token_ids or \
        np.abs(logprobs(first) - logprobs(other)).max() > 1e-3


def test_same_picture_reuses_the_whole_prefix_and_answers_as_cold(llm, cold_split_llm):
    prompt = image_prompt(list(range(100, 137)), [picture(5, 48, 32)], [70, 71, 72], tokens_per_image=24)
    runs_before = llm.engine.stats.num_tower_runs
    cold = cold_split_llm.generate(prompt, GREEDY)[0]
    llm.generate(prompt, GREEDY)
    warm = llm.generate(prompt, GREEDY)[0]
    n = len(prompt["prompt_token_ids"])
    assert warm.num_cached_tokens == (n - 1) // BS * BS
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_allclose(logprobs(warm), logprobs(cold), atol=1e-5)
    assert llm.engine.stats.num_tower_runs == runs_before + 1   # the second run read the cache


def test_growing_chat_with_two_pictures_a_turn_reuses_the_previous_prompt(llm):
    ids, images = [], []
    previous_len = 0
    for turn in range(3):
        images += [picture(20 + 2 * turn), picture(21 + 2 * turn)]
        ids += list(range(200 + turn, 210 + turn))
        for _ in range(2):
            ids += [VS] + [PAD] * 16 + [VE]
        ids += [5, 6, 7]
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": list(images)}}, GREEDY)[0]
        if turn:
            assert out.num_cached_tokens >= previous_len - BS
        ids = ids + list(out.outputs[0].token_ids)
        previous_len = len(ids)


def test_text_only_traffic_hits_as_without_a_tower(llm, text_llm):
    rng = np.random.default_rng(0)
    base = rng.integers(10, 400, 70).tolist()
    prompts = [{"prompt_token_ids": base + rng.integers(10, 400, k).tolist()} for k in (3, 20, 35)]
    cached = []
    for engine in (llm, text_llm):
        engine.engine.cache.manager.clear_prefix_cache()
        cached.append([engine.generate(p, GREEDY)[0].num_cached_tokens for p in prompts])
    assert cached[0] == cached[1] and sum(cached[0]) > 0


def test_a_picture_split_over_prefill_steps_gives_the_one_step_result(llm, cold_split_llm):
    prompt = image_prompt([7, 8, 9], [picture(9, 64, 64)], [11, 12], tokens_per_image=64)
    one_step = llm.generate(prompt, GREEDY)[0]
    split = cold_split_llm.generate(prompt, GREEDY)[0]
    assert split.outputs[0].token_ids == one_step.outputs[0].token_ids
    np.testing.assert_allclose(logprobs(split), logprobs(one_step), atol=1e-4)


def test_text_only_checkpoint_refuses_a_picture_saying_why(text_llm):
    with pytest.raises(ValueError, match="no vision tower"):
        text_llm.generate(image_prompt([1, 2, 3], [picture(1)], [4]), GREEDY)
    with pytest.raises(ValueError, match=r"messages\.0\.content\.0: .*no vision tower"):
        text_llm.chat([{"role": "user", "content": [{"type": "image", "image": picture(1)}]}], GREEDY)


def test_chat_with_a_picture_equals_generate_with_it_and_the_second_call_hits_the_cache(llm, cold_split_llm):
    image = picture(11, 40, 24)
    parts = [{"type": "text", "text": "Look at this: "}, {"type": "image_url", "image_url": {"url": data_url(image)}},
             {"type": "text", "text": " What is it?"}]
    text = ("<|im_start|>user\nLook at this: <|vision_start|><|image_pad|><|vision_end|> What is it?<|im_end|>\n"
            "<|im_start|>assistant\n")
    cold = cold_split_llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}}, GREEDY)[0]
    runs = llm.engine.stats.num_tower_runs
    first = llm.chat([{"role": "user", "content": parts}], GREEDY)[0]
    assert first.prompt_token_ids == cold.prompt_token_ids and first.prompt_token_ids.count(PAD) == 15
    assert first.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_allclose(logprobs(first), logprobs(cold), atol=1e-5)
    parts[1] = {"type": "image", "image": np.asarray(image)}           # the same pixels as an array
    second = llm.chat([{"role": "user", "content": parts}], GREEDY)[0]
    n = len(cold.prompt_token_ids)
    assert second.num_cached_tokens == (n - 1) // BS * BS and llm.engine.stats.num_tower_runs == runs + 1
    assert second.outputs[0].token_ids == cold.outputs[0].token_ids


def claiming(item: VisualInput, digest: str) -> VisualInput:
    """`item` as a caller sends it claiming `digest` as its content hash (which VisualInput once took as given)."""
    try:
        return VisualInput(item.kind, item.pixel_values, item.grid_thw, item.num_tokens, content_hash=digest)
    except TypeError:                                   # the hash is not the caller's to give
        return VisualInput(item.kind, item.pixel_values, item.grid_thw, item.num_tokens)


def test_two_pictures_claiming_one_content_hash_share_no_cache(llm, cold_split_llm):
    cfg = llm.engine.vision.image_preprocess
    first, second = (claiming(preprocess_image(picture(seed), cfg), "ab" * 32) for seed in (31, 32))
    text = list(range(300, 340))                       # 40 tokens: the picture at 40, the last block boundary 32
    llm.generate(image_prompt(text, [first], [60, 61]), GREEDY)
    runs = llm.engine.stats.num_tower_runs
    got = llm.generate(image_prompt(text, [second], [60, 61]), GREEDY)[0]
    cold = cold_split_llm.generate(image_prompt(text, [second], [60, 61]), GREEDY)[0]
    assert got.num_cached_tokens == 32 and llm.engine.stats.num_tower_runs == runs + 1
    assert got.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_allclose(logprobs(got), logprobs(cold), atol=1e-5)


def test_update_weights_brings_the_new_tower_and_drops_its_cached_outputs(paths, tmp_path_factory, llm):
    from qnext.config import ModelConfig
    from qnext.model.loader import load_params
    from qnext.model.vision_weights import load_vision_params

    other = write_vision_checkpoint(tmp_path_factory.mktemp("vlm-other"), seed=4)
    prompt = image_prompt([5, 6, 7], [picture(17)], [8, 9])
    want = qnext.LLM(other, **ENGINE).generate(prompt, GREEDY)[0]
    old = llm.generate(prompt, GREEDY)[0]                   # the old tower's output now in the encoder cache

    def weights(path):
        return load_params(path, ModelConfig.from_pretrained(path)), load_vision_params(path)

    try:
        text, tower = weights(other)
        llm.engine.update_weights(text, vision_params=tower)
        got = llm.generate(prompt, GREEDY)[0]
    finally:
        text, tower = weights(paths[0])
        llm.engine.update_weights(text, vision_params=tower)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    np.testing.assert_allclose(logprobs(got), logprobs(want), atol=1e-5)
    assert np.abs(logprobs(old) - logprobs(want)).max() > 1e-3
    back = llm.generate(prompt, GREEDY)[0]
    np.testing.assert_allclose(logprobs(back), logprobs(old), atol=1e-5)


def test_decode_after_a_picture_runs_multi_step_windows_as_single_steps(paths, llm, cold_split_llm):
    """Positions after a picture are text positions + the sequence's MRoPE delta (here 6 - 30 = -24) on all three
    axes, advanced on device inside a multi-step window: the same draws as one step a call, and the KV the windows
    wrote scores the next turn (a prefix hit) as a cold run does."""
    multi = qnext.LLM(paths[0], **dict(ENGINE, num_scheduler_steps=4))
    prompt = image_prompt([5, 6, 7], [picture(13, 48, 40)], [8, 9], tokens_per_image=30)     # 37 tokens
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    one = llm.generate(prompt, params)[0]
    stats = multi.engine.stats
    many = multi.generate(prompt, params)[0]
    assert many.outputs[0].token_ids == one.outputs[0].token_ids
    assert stats.num_model_steps > stats.num_steps       # decode ran in windows of several steps
    follow = dict(prompt, prompt_token_ids=prompt["prompt_token_ids"] + list(many.outputs[0].token_ids) + [40, 41])
    warm, cold = multi.generate(follow, GREEDY)[0], cold_split_llm.generate(follow, GREEDY)[0]
    assert warm.num_cached_tokens == 48                  # block 2 holds 11 tokens decoded in windows
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_allclose(logprobs(warm), logprobs(cold), atol=1e-4)


def test_mtp_windows_run_sequences_with_pictures_as_plain_decoding(tmp_path_factory, llm):
    """The verify window of a sequence with pictures rotates by token index + its MRoPE delta: greedy tokens and
    logprobs equal plain decoding's (llm: the same seed's weights, no head), and speculative steps ran."""
    import jax

    from qnext.config import ModelConfig
    from qnext.model.loader import load_params
    from qnext.model.mtp import init_mtp_params, save_mtp_params

    path = write_vision_checkpoint(tmp_path_factory.mktemp("vlm-mtp"), seed=3)
    cfg = ModelConfig.from_pretrained(path)
    save_mtp_params(path, init_mtp_params(load_params(path, cfg), cfg, jax.random.key(1)), cfg)
    spec = qnext.LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ENGINE)
    prompt = image_prompt([5, 6, 7], [picture(13, 48, 40)], [8, 9], tokens_per_image=30)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    want, got = llm.generate(prompt, params)[0], spec.generate(prompt, params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    np.testing.assert_allclose(logprobs(got), logprobs(want), atol=1e-4)
    assert spec.engine.stats.num_spec_rows > 0
