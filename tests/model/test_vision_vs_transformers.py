"""Parity with transformers' Qwen3.5 VL models (dense and MoE) on perturbed tiny checkpoints: the tower's output,
the 3-D positions and position delta, and the logits at every position of image-and-text and video-and-text
prompts (float32, within 1e-4), through the engine's step (the Flax model: tests/flax/test_flax_vision.py)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers")

import qnext  # noqa: E402
from qnext.model.vision_weights import load_vision_params  # noqa: E402
from qnext.vision.config import vision_configs  # noqa: E402
from qnext.vision.preprocess import preprocess_image, preprocess_video  # noqa: E402
from qnext.vision.preprocess_config import VisionPreprocessConfig  # noqa: E402
from qnext.vision.prompt_inputs import encode_visuals, visual_prompt  # noqa: E402

TINY = VisionPreprocessConfig(min_pixels=64, max_pixels=4096, patch_size=4)
TOLERANCE = 1e-4
LIN, FULL = "linear_attention", "full_attention"


class VL:
    def __init__(self, family, path):
        import torch
        import transformers as tf

        cls = {"qwen3_5": tf.Qwen3_5ForConditionalGeneration, "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration}
        self.hf = cls[family].from_pretrained(path, dtype=torch.float32).eval()
        self.model = qnext.load_model(path)
        self.vision_params = load_vision_params(path)
        self.cfg, self.ids = vision_configs(json.loads((path / "config.json").read_text()))
        self.rng = np.random.default_rng(11)
        self.family = family

    def image(self, h, w):
        return preprocess_image(Image.fromarray(self.rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), TINY)

    def video(self, frames, h, w):
        pixels = self.rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
        return preprocess_video([Image.fromarray(f) for f in pixels], fps=2.0, cfg=TINY)

    def text(self, n):
        return self.rng.integers(3, 400, n).tolist()

    def wrap(self, pad_id, n):
        return [self.ids.vision_start_token_id] + [pad_id] * n + [self.ids.vision_end_token_id]

    def ours(self, tokens, visuals):
        prompt = visual_prompt(tokens, visuals, self.ids, self.cfg)
        embeds = encode_visuals(self.vision_params, visuals, self.cfg)
        return self.model.logits(tokens, rope_positions=prompt.rope_positions, visual_embeds=embeds,
                                 visual_token_index=prompt.token_index), prompt

    def reference(self, tokens, visuals):
        """(logits [T, V], positions [3, T], delta) of transformers."""
        import torch

        images = [v for v in visuals if v.kind == "image"]
        videos = [v for v in visuals if v.kind == "video"]
        kinds = [1 if t == self.ids.image_token_id else 2 if t == self.ids.video_token_id else 0 for t in tokens]
        kw = dict(input_ids=torch.tensor([tokens]), mm_token_type_ids=torch.tensor([kinds]))
        if images:
            kw.update(pixel_values=torch.tensor(np.concatenate([v.pixel_values for v in images])),
                      image_grid_thw=torch.tensor([v.grid_thw for v in images]))
        if videos:
            kw.update(pixel_values_videos=torch.tensor(np.concatenate([v.pixel_values for v in videos])),
                      video_grid_thw=torch.tensor([v.grid_thw for v in videos]))
        with torch.no_grad():
            logits = self.hf(**kw).logits[0].numpy()
            positions, delta = self.hf.model.get_rope_index(
                kw["input_ids"], kw["mm_token_type_ids"], kw.get("image_grid_thw"), kw.get("video_grid_thw"))
        return logits, positions[:, 0].numpy(), int(delta)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def vl(request, tmp_path_factory):
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5, vlm=True,
                                 fused_experts=request.param == "qwen3_5_moe", layer_types=[LIN, FULL, LIN, FULL])
    return VL(request.param, path)


def test_tower_output_matches_transformers(vl):
    import torch

    visuals = [vl.image(37, 53), vl.image(80, 24), vl.image(16, 16), vl.video(4, 20, 28)]
    ours = np.asarray(encode_visuals(vl.vision_params, visuals, vl.cfg))
    with torch.no_grad():
        ref = vl.hf.model.visual(torch.tensor(np.concatenate([v.pixel_values for v in visuals])),
                                 grid_thw=torch.tensor([v.grid_thw for v in visuals])).pooler_output.numpy()
    assert ours.shape == ref.shape == (sum(v.num_tokens for v in visuals), vl.model.config.hidden_size)
    assert np.abs(ref).max() > 0.5, "tower output too small to show convention bugs"
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_image_and_text_logits_match_transformers(vl):
    wide, tall, square = vl.image(37, 53), vl.image(80, 24), vl.image(24, 24)
    tokens = (vl.text(5) + vl.wrap(vl.ids.image_token_id, wide.num_tokens) + vl.text(4)
              + vl.wrap(vl.ids.image_token_id, tall.num_tokens) + vl.text(3)
              + vl.wrap(vl.ids.image_token_id, square.num_tokens) + vl.text(6))
    assert 64 < len(tokens) <= 128, "keep every prompt of this file in one scoring bucket (one compilation)"
    ours, prompt = vl.ours(tokens, [wide, tall, square])
    ref, positions, delta = vl.reference(tokens, [wide, tall, square])
    np.testing.assert_array_equal(prompt.rope_positions, positions)
    assert prompt.position_delta == delta < 0
    assert np.abs(ref).max() > 0.5
    assert np.abs(ours - ref).max() < TOLERANCE, f"max |diff| {np.abs(ours - ref).max()}"


def test_video_and_text_logits_match_transformers(vl):
    video = vl.video(5, 20, 28)                      # 5 frames: padded to 6, three frame groups
    tokens = vl.text(30)
    for _ in video.timestamps:                        # the template's "<t seconds>" text before each frame group
        tokens += vl.text(3) + vl.wrap(vl.ids.video_token_id, video.tokens_per_frame)
    tokens += vl.text(5)
    assert 64 < len(tokens) <= 128, "keep every prompt of this file in one scoring bucket (one compilation)"
    ours, prompt = vl.ours(tokens, [video])
    ref, positions, delta = vl.reference(tokens, [video])
    np.testing.assert_array_equal(prompt.rope_positions, positions)
    assert prompt.position_delta == delta
    assert np.abs(ours - ref).max() < TOLERANCE, f"max |diff| {np.abs(ours - ref).max()}"


def test_the_image_changes_the_logits_after_it_only(vl):
    first, second = vl.image(24, 40), vl.image(24, 40)
    before = vl.text(40)
    tokens = before + vl.wrap(vl.ids.image_token_id, first.num_tokens) + vl.text(30)
    a, _ = vl.ours(tokens, [first])
    b, _ = vl.ours(tokens, [second])
    np.testing.assert_allclose(a[:len(before) + 1], b[:len(before) + 1], atol=1e-6)   # through <|vision_start|>
    assert np.abs(a[-1] - b[-1]).max() > 1e-3



def test_decode_after_an_image_runs_at_token_index_plus_delta(vl):
    """The engine's contract: prefill with the prompt's 3-D positions, then each decoded token at its token index
    + position_delta (1-D rope positions; the state and KV carried in the cache buffers) gives the logits
    transformers computes for the whole sequence."""
    from qnext.model.cache_layout import model_cache_buffers
    from qnext.model.forward import make_step
    from qnext.model.step_inputs import LayoutSizes, Segment, build_step_inputs
    from qnext.model.visual_inputs import with_visual_inputs

    image = vl.image(37, 53)
    prompt = vl.text(7) + vl.wrap(vl.ids.image_token_id, image.num_tokens) + vl.text(5)
    continuation = vl.text(4)
    ref, _, _ = vl.reference(prompt + continuation, [image])
    visual = visual_prompt(prompt, [image], vl.ids, vl.cfg)
    embeds = encode_visuals(vl.vision_params, [image], vl.cfg)

    cfg, block_size, chunk, blocks = vl.model.config, 16, 32, list(range(1, 9))
    step = make_step(cfg)
    buffers = model_cache_buffers(cfg, num_blocks=9, block_size=block_size, num_state_rows=2, dtype=np.float32)
    seg = Segment(prompt, 0, blocks, read_row=-1, write_row=1)
    inputs = build_step_inputs([seg], LayoutSizes(64, 0, 2, 8, 1), block_size=block_size, chunk=chunk)
    inputs = with_visual_inputs(inputs, visual.rope_positions, embeds, visual.token_index, num_visual_rows=64)
    logits, buffers = step(vl.model.params, buffers, inputs)
    rows = [np.asarray(logits[0])]
    for i, token in enumerate(continuation[:-1]):
        index = len(prompt) + i
        seg = Segment([token], index, blocks, read_row=1, write_row=1)
        inputs = build_step_inputs([seg], LayoutSizes(1, 1, 0, 8, 1), block_size=block_size, chunk=chunk)
        inputs = inputs.replace(rope_positions=np.full(1, index + visual.position_delta, np.int32))
        logits, buffers = step(vl.model.params, buffers, inputs)
        rows.append(np.asarray(logits[0]))
    ours = np.stack(rows)
    expected = ref[len(prompt) - 1:len(prompt) + len(continuation) - 1]
    assert np.abs(ours - expected).max() < TOLERANCE, f"max |diff| {np.abs(ours - expected).max()}"


def test_tower_at_qwen35_geometry_matches_transformers():
    """Qwen3.5's own tower geometry, one block: hidden 1152 in 16 heads of 72 (the 2-D RoPE over a head dim that is
    not a power of two), the 48 x 48 position table resampled, patch 16 and Qwen3.5's default preprocessing."""
    import torch
    import transformers as tf

    from qnext.model.vision_weights import vision_params_from_tensors
    from qnext.vision.config import VisionConfig
    from qnext.vision.preprocess_config import DEFAULT_IMAGE_CONFIG

    torch.manual_seed(0)
    hf_cfg = tf.Qwen3_5VisionConfig(depth=1, out_hidden_size=64)
    tower = tf.Qwen3_5VisionModel(hf_cfg).eval()
    with torch.no_grad():
        for _, p in tower.named_parameters():
            p.add_(torch.randn(p.shape) * (0.2 if p.ndim == 1 else 0.02))
    cfg = VisionConfig.from_hf(hf_cfg.to_dict())
    assert (cfg.head_dim, cfg.position_grid_side, cfg.patch_size) == (72, 48, 16)
    params = vision_params_from_tensors({k: v.numpy() for k, v in tower.state_dict().items()}, cfg)
    rng = np.random.default_rng(3)
    small = dataclasses.replace(DEFAULT_IMAGE_CONFIG, min_pixels=32 * 32, max_pixels=160 * 160)
    visuals = [preprocess_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), small)
               for h, w in [(100, 150), (64, 64), (150, 40)]]
    ours = np.asarray(encode_visuals(params, visuals, cfg))
    with torch.no_grad():
        ref = tower(torch.tensor(np.concatenate([v.pixel_values for v in visuals])),
                    grid_thw=torch.tensor([v.grid_thw for v in visuals])).pooler_output.numpy()
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(ours, ref, atol=2e-5)
