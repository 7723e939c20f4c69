"""Convert a Hugging Face checkpoint once and store it with orbax, so later loads skip the conversion.

    python scripts/convert_checkpoint.py --model /path/to/Qwen3.5-35B-A3B --out ~/.cache/qnext/converted --dtype bfloat16

Then `load_checkpoint(model, dtype, cache_dir=out)` (qnext/model/checkpoint.py; `qnext.load_model` takes the same
cache_dir) restores it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qnext.model import converted_params_store  # noqa: E402
from qnext.model.checkpoint import load_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="cache directory for converted checkpoints")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("qnext").setLevel(logging.INFO)

    start = time.perf_counter()
    try:
        cfg = load_checkpoint(args.model, args.dtype, cache_dir=args.out).config
        key = converted_params_store.cache_key(args.model, args.dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model} ({cfg.model_type}, {args.dtype}) -> {args.out.resolve() / key} "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
