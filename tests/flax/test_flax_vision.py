"""The Flax model takes images and video: a left-padded batch of image-and-text rows gives transformers' logits,
gradients reach the vision tower, and save_pretrained writes the tower as trained."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers")

import qnext.flax as qflax  # noqa: E402
from flax import nnx  # noqa: E402
from qnext.model.vision_weights import load_vision_params  # noqa: E402
from qnext.vision.preprocess import preprocess_image, preprocess_video  # noqa: E402
from qnext.vision.preprocess_config import VisionPreprocessConfig  # noqa: E402

TINY = VisionPreprocessConfig(min_pixels=64, max_pixels=4096, patch_size=4)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("vl"), "qwen3_5", seed=9, vlm=True, num_hidden_layers=2,
                                 layer_types=["linear_attention", "full_attention"])
    return Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval(), path


def batch(model, rng):
    """Two left-padded rows: text + an image + text, and text + a 3-frame video (2 frame groups) + text."""
    ids = model.vision.token_ids
    pixels = lambda *shape: rng.integers(0, 256, shape, dtype=np.uint8)   # noqa: E731
    image = preprocess_image(Image.fromarray(pixels(37, 53, 3)), TINY)
    video = preprocess_video([Image.fromarray(f) for f in pixels(3, 20, 28, 3)], fps=2.0, cfg=TINY)
    wrap = lambda pad, n: [ids.vision_start_token_id] + [pad] * n + [ids.vision_end_token_id]   # noqa: E731
    row0 = [7, 8, 9] + wrap(ids.image_token_id, image.num_tokens) + [10, 11]
    row1 = [12] + sum((wrap(ids.video_token_id, video.tokens_per_frame) + [13] for _ in video.timestamps), []) + [14]
    width = max(len(row0), len(row1)) + 2
    input_ids = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    for b, row in enumerate((row0, row1)):
        input_ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    return input_ids, mask, [[image], [video]], [row0, row1]


def hf_row_logits(hf, tokens, visual, ids):
    import torch

    kinds = [1 if t == ids.image_token_id else 2 if t == ids.video_token_id else 0 for t in tokens]
    key = "pixel_values" if visual.kind == "image" else "pixel_values_videos"
    grid = "image_grid_thw" if visual.kind == "image" else "video_grid_thw"
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens]), mm_token_type_ids=torch.tensor([kinds]),
                  **{key: torch.tensor(visual.pixel_values), grid: torch.tensor([visual.grid_thw])}).logits[0].numpy()


def test_logits_match_transformers_gradients_reach_the_tower_and_save_writes_it(vl, tmp_path):
    """One jitted value-and-grad (one compilation): its logits are transformers' per row at the real tokens."""
    hf, path = vl
    model = qflax.from_pretrained(path)
    input_ids, mask, visuals, rows = batch(model, np.random.default_rng(0))
    inputs = qflax.image_batch(model, input_ids, mask, visuals)
    grid = inputs.pop("grid_thw")                                   # static: closed over

    def loss(m, pixel_values, rope_positions):
        logits = m(input_ids, mask, pixel_values, grid, rope_positions)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * mask), logits

    (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(
        model, jnp.asarray(inputs["pixel_values"]), jnp.asarray(inputs["rope_positions"]))
    logits = np.asarray(logits)
    for b, row in enumerate(rows):
        ref = hf_row_logits(hf, row, visuals[b][0], model.vision.token_ids)
        assert np.abs(logits[b, -len(row):] - ref).max() < 1e-4, (b, np.abs(logits[b, -len(row):] - ref).max())

    tower_grads = jax.tree.leaves(nnx.to_pure_dict(grads)["vision"])
    assert tower_grads and all(np.isfinite(np.asarray(g)).all() for g in tower_grads)
    assert min(float(np.abs(np.asarray(g)).max()) for g in tower_grads) > 0, "a tower parameter gets no gradient"

    model.vision.pos_embed[...] = model.vision.pos_embed[...] + 1.0                    # "trained"
    out = qflax.save_pretrained(model, tmp_path / "saved")
    np.testing.assert_array_equal(load_vision_params(out)["pos_embed"], np.asarray(model.vision.pos_embed[...]))
