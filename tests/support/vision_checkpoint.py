"""Tiny Qwen3.5 vision-language checkpoints for the serving tests (the tiny tower: patch 4, merge 2, pictures of
64..4096 pixels, so a 32x32 picture is 16 tokens), pictures made of random pixels, and data URLs of them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from qnext.testing.tiny_checkpoint import write_tiny_checkpoint


def write_vision_checkpoint(out_dir: Path, family: str = "qwen3_5", tokenizer: str = "tiny", **kwargs) -> Path:
    return write_tiny_checkpoint(out_dir, family, vlm=True, tokenizer=tokenizer, **kwargs)


def picture(seed: int, width: int = 32, height: int = 32) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def png_base64(image: Image.Image) -> str:
    return data_url(image).split(",", 1)[1]


def without_tower(vlm_path: Path, out_dir: Path) -> Path:
    """A copy of a vision-language checkpoint with its `model.visual.*` tensors removed: the same text model (and the
    same model config, so engines share compilations) with no tower."""
    import shutil

    from safetensors.numpy import load_file, save_file

    out_dir = Path(out_dir)
    shutil.copytree(vlm_path, out_dir, dirs_exist_ok=True)
    tensors = load_file(str(out_dir / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
