"""Images and videos -> the tower's input, without torch: the arrays transformers' Qwen3-VL processors make.

Steps (transformers' PIL image processor, Qwen2VLImageProcessorPil, which Qwen3.5 checkpoints use):
RGB (transparency composited on white) -> smart resize (both sides multiples of patch * merge, pixels within
[min_pixels, max_pixels], aspect ratio kept) with PIL bicubic on uint8 -> x / 255 (float64, cast to float32) ->
(x - mean) / std (float32) -> patches. A patch row is one (C, temporal_patch, patch, patch) cube flattened in that
order; rows are ordered frame group by frame group, and inside a frame by merge block (the 2x2 patches that become
one text token are adjacent). An image is one frame repeated temporal_patch times.

Videos arrive as already-decoded frames with their source indices and frame rate; they are resized as one clip
(the video smart resize, which budgets pixels over all frames), padded to a multiple of temporal_patch by
repeating the last frame, and each temporal patch gets the timestamp the chat template prints before it: the mean
of its first and last frame's time, in seconds.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Sequence

import numpy as np
from PIL import Image

from qnext.vision.preprocess_config import DEFAULT_IMAGE_CONFIG, DEFAULT_VIDEO_CONFIG, VisionPreprocessConfig

MAX_ASPECT_RATIO = 200


@dataclasses.dataclass(frozen=True, eq=False)
class VisualInput:
    kind: str                           # "image" | "video"
    pixel_values: np.ndarray            # [num_patches, C * temporal_patch * patch * patch] float32
    grid_thw: tuple[int, int, int]      # patches along time (temporal patches), height, width
    num_tokens: int                     # prompt pad tokens: t * h * w / merge^2 (per frame group: h * w / merge^2)
    timestamps: tuple[float, ...] = ()  # videos: seconds per temporal patch, as the template prints them
    # SHA-256 hex of what the tower reads (kind, grid, timestamps, pixel_values' float32 bytes), computed here and
    # never taken from the caller: the prefix and encoder caches key on it, so it must be the pixels' own
    content_hash: str = dataclasses.field(init=False)

    def __post_init__(self):
        if self.kind not in ("image", "video"):
            raise ValueError(f"a visual input's kind is 'image' or 'video', got {self.kind!r}")
        pixels = np.ascontiguousarray(self.pixel_values, dtype=np.float32)
        object.__setattr__(self, "grid_thw", tuple(int(n) for n in self.grid_thw))
        t, h, w = self.grid_thw
        if pixels.ndim != 2 or pixels.shape[0] != t * h * w:
            raise ValueError(f"pixel_values has shape {list(np.shape(self.pixel_values))}; grid_thw {self.grid_thw} "
                             f"needs {t * h * w} rows (one per patch)")
        object.__setattr__(self, "pixel_values", pixels)
        object.__setattr__(self, "content_hash", _content_hash(self.kind, self.grid_thw, self.timestamps, pixels))

    @property
    def tokens_per_frame(self) -> int:
        return self.num_tokens // self.grid_thw[0]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 num_frames: int = 1, temporal_factor: int = 1) -> tuple[int, int]:
    """(height, width), multiples of `factor`, aspect ratio kept, frames * pixels within [min_pixels, max_pixels].
    Images: num_frames = temporal_factor = 1 (transformers' image smart_resize); videos: the clip's frame count and
    the temporal patch (its video smart_resize, which also scales up a side shorter than `factor` first)."""
    if temporal_factor > 1:
        if num_frames < temporal_factor:
            raise ValueError(f"a video needs at least {temporal_factor} frames (the temporal patch); got {num_frames}")
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
                         f"{MAX_ASPECT_RATIO}; crop or pad the image")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor if temporal_factor > 1 else 1
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(height: int, width: int, cfg: VisionPreprocessConfig = DEFAULT_IMAGE_CONFIG) -> tuple[int, int, int]:
    """The patch grid (t, h, w) an image of this size becomes: known from its header, before any decoding."""
    h, w = smart_resize(height, width, cfg.resize_factor, cfg.min_pixels, cfg.max_pixels)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def video_grid(num_frames: int, height: int, width: int, cfg: VisionPreprocessConfig = DEFAULT_VIDEO_CONFIG
               ) -> tuple[int, int, int]:
    """The patch grid (t, h, w) a clip of num_frames frames of this size becomes (frames padded to a multiple of
    the temporal patch)."""
    tp = cfg.temporal_patch_size
    h, w = smart_resize(height, width, cfg.resize_factor, cfg.min_pixels, cfg.max_pixels,
                        num_frames=max(num_frames, tp), temporal_factor=tp)
    return -(-num_frames // tp), h // cfg.patch_size, w // cfg.patch_size


def grid_tokens(grid: tuple[int, int, int], cfg: VisionPreprocessConfig) -> int:
    """Prompt pad tokens of a grid: one per merged patch."""
    return grid[0] * grid[1] * grid[2] // cfg.merge_size ** 2


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess_image(image: Image.Image, cfg: VisionPreprocessConfig = DEFAULT_IMAGE_CONFIG) -> VisualInput:
    rgb = to_rgb(image)
    grid = image_grid(rgb.height, rgb.width, cfg)
    frame = _normalize(_resize(rgb, grid[1] * cfg.patch_size, grid[2] * cfg.patch_size), cfg)   # [3, h, w] float32
    pixels = _patchify(np.broadcast_to(frame, (cfg.temporal_patch_size,) + frame.shape), cfg)
    return VisualInput("image", pixels, grid, grid_tokens(grid, cfg))


def preprocess_video(frames: Sequence[Image.Image], fps: float, cfg: VisionPreprocessConfig = DEFAULT_VIDEO_CONFIG,
                     frame_indices: Sequence[int] | None = None) -> VisualInput:
    """frames: the sampled frames, all of one size; fps: the source video's frame rate; frame_indices: each
    frame's index in the source (default 0, 1, ...), which with fps gives the timestamps."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    if fps <= 0:
        raise ValueError(f"video fps must be positive, got {fps}")
    indices = list(range(len(frames))) if frame_indices is None else [int(i) for i in frame_indices]
    if len(indices) != len(frames):
        raise ValueError(f"{len(frames)} frames but {len(indices)} frame indices")
    rgb = [to_rgb(f) for f in frames]
    if len({f.size for f in rgb}) != 1:
        raise ValueError(f"video frames differ in size: {sorted({f.size for f in rgb})}; resize them to one size")
    tp = cfg.temporal_patch_size
    grid = video_grid(len(rgb), rgb[0].height, rgb[0].width, cfg)
    height, width = grid[1] * cfg.patch_size, grid[2] * cfg.patch_size
    clip = np.stack([_normalize(_resize(f, height, width), cfg) for f in rgb])    # [T, 3, h, w]
    pad = -len(rgb) % tp
    if pad:
        clip = np.concatenate([clip, np.repeat(clip[-1:], pad, axis=0)])
        indices = indices + [indices[-1]] * pad
    seconds = [i / fps for i in indices]
    timestamps = tuple((seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp))
    return VisualInput("video", _patchify(clip, cfg), grid, grid_tokens(grid, cfg), timestamps)


def sample_frame_indices(total_frames: int, source_fps: float, cfg: VisionPreprocessConfig = DEFAULT_VIDEO_CONFIG
                         ) -> list[int]:
    """Which of a video's frames to keep: cfg.fps frames a second, within [min_frames, max_frames] and the
    frames there are, spread evenly (transformers' Qwen3VLVideoProcessor.sample_frames)."""
    wanted = int(total_frames / source_fps * cfg.fps)
    wanted = min(max(wanted, cfg.min_frames), cfg.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, wanted).round().astype(int).tolist()


def _resize(image: Image.Image, height: int, width: int) -> np.ndarray:
    """PIL bicubic on the uint8 image -> [3, h, w] uint8."""
    resized = image if image.size == (width, height) else image.resize((width, height), Image.Resampling.BICUBIC)
    return np.moveaxis(np.asarray(resized), -1, 0)


def _normalize(frame: np.ndarray, cfg: VisionPreprocessConfig) -> np.ndarray:
    """uint8 [3, h, w] -> float32: (x * rescale (in float64, then float32) - mean) / std in float32."""
    x = (frame.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    return ((x - mean[:, None, None]) / std[:, None, None]).astype(np.float32)


def _patchify(clip: np.ndarray, cfg: VisionPreprocessConfig) -> np.ndarray:
    """[T, C, H, W] (T a multiple of temporal_patch) -> [T/tp * gh * gw, C * tp * p * p]: rows by frame group,
    then merge block row, merge block column, row in block, column in block; columns (C, tp, p, p)."""
    t, c, h, w = clip.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gt, gh, gw = t // tp, h // p, w // p
    cubes = clip.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    cubes = cubes.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)        # gt, bh, bw, mh, mw, C, tp, ph, pw
    return np.ascontiguousarray(cubes.reshape(gt * gh * gw, c * tp * p * p), dtype=np.float32)


def _content_hash(kind: str, grid: tuple[int, int, int], timestamps: tuple[float, ...], pixels: np.ndarray) -> str:
    """SHA-256 over everything the tower's output and the pads' layout depend on: equal exactly when the tower's
    input is equal (never a truncated hash). Two pictures that preprocess to the same arrays share it, rightly."""
    h = hashlib.sha256(f"{kind}\n{tuple(grid)}\n{list(timestamps)!r}\n{pixels.shape}\n".encode())
    h.update(memoryview(pixels).cast("B"))
    return h.hexdigest()
