"""Time of the vision tower per image: preprocessing (host) and the jitted tower (device), compilation excluded.

Builds a tiny VL checkpoint (or reads --checkpoint), preprocesses --images random images of each --sizes entry
with the checkpoint's preprocessing (the tiny tower: patch 4 and 64..--max-pixels pixels), runs the tower once per
grid to compile, then times --repeats passes of one image per call and reports the median per image.

    python scripts/bench_vision_tower.py --sizes 64x64 224x224 448x336 --json-out docs/bench/vision-tower-cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from PIL import Image

from qnext.config import read_json
from qnext.model.vision_weights import load_vision_params
from qnext.vision.config import vision_configs
from qnext.vision.preprocess import preprocess_image
from qnext.vision.preprocess_config import VisionPreprocessConfig, load_preprocess_configs
from qnext.vision.tower import make_encode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a VL checkpoint directory (default: a tiny one, written to a temp dir)")
    parser.add_argument("--sizes", nargs="+", default=["64x64", "224x224", "448x336"], help="HEIGHTxWIDTH images")
    parser.add_argument("--max-pixels", type=int, default=448 * 448, help="the tiny checkpoint's max_pixels")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json-out")
    args = parser.parse_args()

    if args.checkpoint:
        path = Path(args.checkpoint)
        image_cfg = load_preprocess_configs(path)[0]
    else:
        from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

        path = write_tiny_checkpoint(tempfile.mkdtemp(prefix="qnext-vision-bench-"), "qwen3_5", vlm=True)
        image_cfg = VisionPreprocessConfig(min_pixels=64, max_pixels=args.max_pixels, patch_size=4)
    cfg, _ = vision_configs(read_json(path / "config.json"))
    params = jax.device_put(load_vision_params(path, args.dtype))
    encode = make_encode(cfg)
    rng = np.random.default_rng(0)
    rows = []
    for size in args.sizes:
        h, w = (int(v) for v in size.lower().split("x"))
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(args.repeats)]
        start = time.perf_counter()
        visuals = [preprocess_image(im, image_cfg) for im in images]
        preprocess_ms = (time.perf_counter() - start) / len(images) * 1e3
        grid = visuals[0].grid_thw
        start = time.perf_counter()
        encode(params, visuals[0].pixel_values, grid).block_until_ready()
        compile_s = time.perf_counter() - start
        times = []
        for v in visuals:
            start = time.perf_counter()
            encode(params, v.pixel_values, grid).block_until_ready()
            times.append((time.perf_counter() - start) * 1e3)
        rows.append({"image": f"{h}x{w}", "grid_thw": list(grid), "patches": int(np.prod(grid)),
                     "tokens": visuals[0].num_tokens, "preprocess_ms": round(preprocess_ms, 3),
                     "tower_ms_median": round(statistics.median(times), 3), "tower_ms_min": round(min(times), 3),
                     "first_call_s": round(compile_s, 2)})
        print(json.dumps(rows[-1]))
    result = {"device": str(jax.devices()[0]), "dtype": args.dtype,
              "tower": {"depth": cfg.depth, "hidden_size": cfg.hidden_size, "patch_size": cfg.patch_size},
              "images": rows}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
