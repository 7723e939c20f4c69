"""Image and video preprocessing parameters: the checkpoint's preprocessor_config.json and
video_preprocessor_config.json when present, Qwen3.5's published defaults otherwise (Qwen3-VL's processor values:
patch 16, temporal patch 2, merge 2, mean = std = 0.5; images 65,536..16,777,216 pixels, videos 4,096..25,165,824
pixels over all frames at 2 fps, 4..768 frames)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

IMAGE_CONFIG_FILE = "preprocessor_config.json"
VIDEO_CONFIG_FILE = "video_preprocessor_config.json"
_BICUBIC = 3   # PIL.Image.Resampling.BICUBIC, the processors' `resample`


@dataclasses.dataclass(frozen=True)
class VisionPreprocessConfig:
    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = _BICUBIC
    # videos only
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @property
    def resize_factor(self) -> int:
        """Resized sides are multiples of this: one merged patch."""
        return self.patch_size * self.merge_size

    def fingerprint(self) -> str:
        """Every parameter that changes the arrays, as canonical JSON (part of an input's content hash)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_hf(cls, d: dict[str, Any], base: "VisionPreprocessConfig | None" = None) -> "VisionPreprocessConfig":
        """From a parsed (video_)preprocessor_config.json; fields it lacks come from `base` (default: images)."""
        base = base or cls()
        size = d.get("size") or {}
        values = dict(
            min_pixels=d.get("min_pixels", size.get("shortest_edge", base.min_pixels)),
            max_pixels=d.get("max_pixels", size.get("longest_edge", base.max_pixels)),
            patch_size=d.get("patch_size", base.patch_size),
            temporal_patch_size=d.get("temporal_patch_size", base.temporal_patch_size),
            merge_size=d.get("merge_size", base.merge_size),
            image_mean=tuple(float(x) for x in d.get("image_mean", base.image_mean)),
            image_std=tuple(float(x) for x in d.get("image_std", base.image_std)),
            rescale_factor=float(d.get("rescale_factor", base.rescale_factor)),
            resample=d.get("resample", base.resample),
            fps=float(d.get("fps", base.fps)),
            min_frames=d.get("min_frames", base.min_frames),
            max_frames=d.get("max_frames", base.max_frames),
        )
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "min_frames",
                     "max_frames"):
            if isinstance(values[name], bool) or not isinstance(values[name], int) or values[name] < 1:
                raise ValueError(f"preprocessor config field {name!r} must be a positive integer, got "
                                 f"{values[name]!r}")
        if values["resample"] != _BICUBIC:
            raise ValueError(f"preprocessor config 'resample' {values['resample']!r} is not supported; only bicubic "
                             f"({_BICUBIC}) is, as Qwen's processors use")
        if len(values["image_mean"]) != 3 or len(values["image_std"]) != 3:
            raise ValueError("preprocessor config 'image_mean' and 'image_std' need 3 values (RGB)")
        if values["min_pixels"] > values["max_pixels"]:
            raise ValueError(f"preprocessor config min pixels {values['min_pixels']} exceed max pixels "
                             f"{values['max_pixels']}")
        return cls(**values)


DEFAULT_IMAGE_CONFIG = VisionPreprocessConfig()
DEFAULT_VIDEO_CONFIG = VisionPreprocessConfig(min_pixels=4096, max_pixels=25165824)


def load_preprocess_configs(path: str | Path) -> tuple[VisionPreprocessConfig, VisionPreprocessConfig]:
    """(image config, video config) of a checkpoint directory. Patch sizes default to the tower's (config.json's
    vision_config), the rest to Qwen3.5's defaults; the video file falls back on the image file's values (patch
    sizes, mean / std) and then on the video defaults. ValueError when a file's patch sizes contradict the tower."""
    path = Path(path)
    tower = _tower_patch_sizes(path)

    def read(name: str) -> dict[str, Any] | None:
        f = path / name
        if not f.is_file():
            return None
        try:
            return json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{f} is not valid JSON: {e}") from None

    image_json, video_json = read(IMAGE_CONFIG_FILE), read(VIDEO_CONFIG_FILE)
    image_base = VisionPreprocessConfig.from_hf(tower, DEFAULT_IMAGE_CONFIG)
    image = VisionPreprocessConfig.from_hf(image_json, image_base) if image_json else image_base
    shared = {k: (image_json or {})[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean",
                                                 "image_std", "rescale_factor") if k in (image_json or {})}
    video_base = VisionPreprocessConfig.from_hf({**tower, **shared}, DEFAULT_VIDEO_CONFIG)
    video = VisionPreprocessConfig.from_hf(video_json, video_base) if video_json else video_base
    for name, cfg in ((IMAGE_CONFIG_FILE, image), (VIDEO_CONFIG_FILE, video)):
        for key, value in tower.items():
            if getattr(cfg, key) != value:
                raise ValueError(f"{path / name} has {key} {getattr(cfg, key)}; the checkpoint's vision tower "
                                 f"(config.json vision_config) has {value}")
    return image, video


def _tower_patch_sizes(path: Path) -> dict[str, int]:
    """patch_size, temporal_patch_size, merge_size of config.json's vision_config (empty without a tower)."""
    f = path / "config.json"
    if not f.is_file():
        return {}
    vision = json.loads(f.read_text()).get("vision_config")
    if not isinstance(vision, dict):
        return {}
    names = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
             "merge_size": "spatial_merge_size"}
    return {ours: vision[theirs] for ours, theirs in names.items() if isinstance(vision.get(theirs), int)}
