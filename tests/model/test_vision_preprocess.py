"""Preprocessing without torch makes the arrays transformers' Qwen3-VL processors make (images: the PIL image
processor, Qwen2VLImageProcessorPil, which Qwen3.5 checkpoints load when torchvision is absent; videos: the video
processor with its torchvision-only steps off, its smart_resize and frame sampling, and the processor's timestamps),
and the content hash tells inputs apart."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from qnext.vision.preprocess import VisualInput, preprocess_image, preprocess_video, sample_frame_indices, smart_resize
from qnext.vision.preprocess_config import (DEFAULT_IMAGE_CONFIG, DEFAULT_VIDEO_CONFIG, VisionPreprocessConfig,
                                            load_preprocess_configs)

pytest.importorskip("transformers")

TINY = VisionPreprocessConfig(min_pixels=64, max_pixels=4096, patch_size=4)   # the tiny tower's patch size
SIZES = [(37, 53), (80, 24), (16, 16), (5, 90), (300, 200)]                  # (height, width): tall, wide, small


def random_image(h, w, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": None}[mode]
    shape = (h, w) if channels is None else (h, w, channels)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


def hf_image_processor(cfg: VisionPreprocessConfig):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
                                    patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                                    merge_size=cfg.merge_size, image_mean=list(cfg.image_mean),
                                    image_std=list(cfg.image_std))


@pytest.mark.parametrize("cfg", [TINY, DEFAULT_IMAGE_CONFIG, VisionPreprocessConfig(
    min_pixels=256, max_pixels=20000, patch_size=8, image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711))], ids=["tiny", "qwen3.5", "clip-mean"])
def test_image_arrays_equal_transformers(cfg):
    processor = hf_image_processor(cfg)
    for i, (h, w) in enumerate(SIZES):
        for mode in ("RGB", "RGBA", "L"):
            image = random_image(h, w, mode, seed=i)
            ours = preprocess_image(image, cfg)
            ref = processor(images=[image], return_tensors="np")
            assert ours.grid_thw == tuple(ref["image_grid_thw"][0]), (h, w, mode)
            assert ours.pixel_values.dtype == np.float32
            np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"], err_msg=f"{(h, w, mode)}")
            assert ours.num_tokens == np.prod(ref["image_grid_thw"][0]) // cfg.merge_size ** 2


def test_video_layout_sizes_and_timestamps_equal_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_video_resize
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_image_resize

    cfg = DEFAULT_VIDEO_CONFIG
    for frames, h, w in [(2, 30, 500), (4, 480, 640), (9, 1080, 1920), (64, 720, 1280), (3, 20, 20)]:
        assert smart_resize(h, w, 32, cfg.min_pixels, cfg.max_pixels, frames, 2) == hf_video_resize(
            frames, h, w, 2, 32, cfg.min_pixels, cfg.max_pixels)
        assert smart_resize(h, w, 32, 65536, 16777216) == hf_image_resize(h, w, 32, 65536, 16777216)

    # The video processor itself, with its torchvision-only steps (resize, RGB conversion, normalisation) off:
    # frames at a size the resize keeps, mean 0 and std 1. Frame padding, rescale and patch layout decide.
    frames = [random_image(24, 40, seed=s) for s in range(5)]
    plain = VisionPreprocessConfig(min_pixels=64, max_pixels=100000, patch_size=4, image_mean=(0.0, 0.0, 0.0),
                                   image_std=(1.0, 1.0, 1.0))
    video = preprocess_video(frames, fps=4.0, cfg=plain, frame_indices=[0, 3, 6, 9, 12])
    hf = Qwen3VLVideoProcessor(patch_size=4, do_resize=False, do_sample_frames=False, do_convert_rgb=False,
                               do_normalize=False, cap_pixels_per_frame=False)
    ref = hf(videos=[np.stack([np.asarray(f) for f in frames])], return_tensors="np")
    assert video.grid_thw == tuple(ref["video_grid_thw"][0]) == (3, 6, 10)
    np.testing.assert_allclose(video.pixel_values, ref["pixel_values_videos"], atol=1e-7)
    assert video.timestamps == tuple(Qwen3VLProcessor._calculate_timestamps(None, [0, 3, 6, 9, 12], 4.0, 2))
    assert video.num_tokens == 3 * 6 * 10 // 4 and video.tokens_per_frame == 15

    class Metadata:
        total_num_frames, fps = 300, 30.0

    hf_video = Qwen3VLVideoProcessor()
    assert sample_frame_indices(300, 30.0) == hf_video.sample_frames(Metadata()).tolist()


def test_content_hash_tells_inputs_apart():
    image = random_image(40, 56)                          # a size TINY keeps: no resize hides a changed pixel
    first = preprocess_image(image, TINY)
    assert len(first.content_hash) == 64 and int(first.content_hash, 16) >= 0        # full SHA-256 hex
    assert preprocess_image(image.copy(), TINY).content_hash == first.content_hash
    pixels = np.asarray(image).copy()
    pixels[0, 0, 0] ^= 1                                                               # one bit of one pixel
    assert preprocess_image(Image.fromarray(pixels), TINY).content_hash != first.content_hash
    assert preprocess_image(image, VisionPreprocessConfig(min_pixels=64, max_pixels=2048, patch_size=4)
                            ).content_hash != first.content_hash                     # other processing
    frames = [random_image(24, 40, seed=s) for s in range(4)]
    video = preprocess_video(frames, 2.0, TINY)
    assert video.content_hash != preprocess_video(frames, 1.0, TINY).content_hash      # other timestamps
    assert video.content_hash != preprocess_video(frames[::-1], 2.0, TINY).content_hash


def test_content_hash_is_the_pixels_own_never_the_callers():
    first = preprocess_image(random_image(40, 56), TINY)
    args = (first.kind, first.pixel_values, first.grid_thw, first.num_tokens)
    assert VisualInput(*args).content_hash == first.content_hash
    with pytest.raises(TypeError):
        VisualInput(*args, content_hash="0" * 64)
    with pytest.raises(ValueError, match=r"grid_thw \(1, 10, 14\) needs 140 rows"):
        VisualInput(first.kind, first.pixel_values[:-1], first.grid_thw, first.num_tokens)


def test_configs_come_from_the_checkpoint_files(tmp_path):
    assert load_preprocess_configs(tmp_path) == (DEFAULT_IMAGE_CONFIG, DEFAULT_VIDEO_CONFIG)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 1024, "longest_edge": 8192}, "patch_size": 14, "image_mean": [0.1, 0.2, 0.3]}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"max_pixels": 99999, "fps": 1}))
    image, video = load_preprocess_configs(tmp_path)
    assert (image.min_pixels, image.max_pixels, image.patch_size, image.image_mean) == (1024, 8192, 14, (0.1, 0.2, 0.3))
    assert (video.patch_size, video.image_mean, video.min_pixels, video.max_pixels, video.fps) == (
        14, (0.1, 0.2, 0.3), DEFAULT_VIDEO_CONFIG.min_pixels, 99999, 1.0)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"resample": 2}))
    with pytest.raises(ValueError, match="bicubic"):
        load_preprocess_configs(tmp_path)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="aspect ratio"):
        preprocess_image(random_image(2, 500), TINY)
    with pytest.raises(ValueError, match="differ in size"):
        preprocess_video([random_image(24, 40), random_image(40, 24)], 2.0, TINY)


def test_tiny_checkpoints_carry_their_towers_preprocessing(tiny_checkpoint, tmp_path):
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    path = tiny_checkpoint("qwen3_5", vlm=True)
    image, video = load_preprocess_configs(path)
    assert (image.patch_size, video.patch_size, image.max_pixels) == (4, 4, 64 * 64)
    assert preprocess_image(random_image(37, 53), image).pixel_values.shape[1] == 3 * 2 * 4 * 4
    wrong = write_tiny_checkpoint(tmp_path, "qwen3_5", vlm=True)
    (wrong / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    with pytest.raises(ValueError, match="patch_size 16; the checkpoint's vision tower"):
        load_preprocess_configs(wrong)
    (wrong / "preprocessor_config.json").unlink()
    assert load_preprocess_configs(wrong)[0].patch_size == 4          # the tower's, without a file
