"""Vision serving: a 4-turn chat with 2 pictures a turn on a preset's text model plus a tiny tower (docs/vision.md,
"Serving"): the 4th turn's time to first token with the prefix cache against without it, the encoder cache's hits
and the tower's time per picture. Three configurations, each on its own engine, the same measured chat:

- cached: prefix cache (image-aware block hashes, snapshot before each <|vision_start|>) and encoder cache;
- encoder cache only: no prefix cache, so every turn recomputes its prompt, but resent pictures skip the tower;
- uncached: neither.

    python scripts/bench_vision.py                          # small preset, 128x128 pictures (256 tokens each)
    python scripts/bench_vision.py --preset tiny --json-out bench_out/vision.json
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qnext.bench.presets import PRESETS  # noqa: E402
from qnext.bench.vision_chat import ChatShape, run_chat, vision_checkpoint  # noqa: E402

CONFIGS = {"cached": dict(enable_prefix_caching=True),
           "encoder cache only": dict(enable_prefix_caching=False),
           "uncached": dict(enable_prefix_caching=False, encoder_cache_bytes=0)}


def measure(path: Path, options: dict, shape: ChatShape) -> dict:
    from qnext.engine.llm_engine import LLMEngine

    engine = LLMEngine(path, **options)
    run_chat(engine, shape, seed=0)                  # compiles every shape; its pictures are not reused below
    stats = engine.stats
    runs, seconds, hits = stats.num_tower_runs, stats.tower_seconds, stats.num_encoder_cache_hits
    turns = run_chat(engine, shape, seed=1)
    runs = stats.num_tower_runs - runs
    return {"turns": turns, "tower_runs": runs, "tower_ms_per_image": 1e3 * (stats.tower_seconds - seconds) / max(1, runs),
            "encoder_cache_hits": stats.num_encoder_cache_hits - hits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--root", default="bench_out/checkpoints", help="where the preset's checkpoint is written")
    ap.add_argument("--image-side", type=int, default=128, help="picture side in pixels ((side / 8)^2 tokens)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--images-per-turn", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    shape = ChatShape(turns=args.turns, images_per_turn=args.images_per_turn, image_side=args.image_side)
    path = vision_checkpoint(args.preset, args.root, args.image_side)
    engine_options = dict(max_model_len=4096, max_num_seqs=4,
                          max_num_batched_tokens=PRESETS[args.preset].max_num_batched_tokens)
    results = {name: measure(path, dict(engine_options, **options), shape) for name, options in CONFIGS.items()}
    last = {name: r["turns"][-1]["ttft_s"] for name, r in results.items()}
    print(f"{args.preset} + tiny tower, {args.turns} turns x {args.images_per_turn} pictures of "
          f"{(args.image_side // 8) ** 2} tokens; turn {args.turns} prompt "
          f"{results['cached']['turns'][-1]['prompt_tokens']} tokens")
    print(f"{'configuration':<20}{'turn-4 TTFT ms':>16}{'vs uncached':>13}{'cached tok':>12}{'tower runs':>12}"
          f"{'enc. hits':>11}{'tower ms/img':>14}")
    for name, r in results.items():
        print(f"{name:<20}{1e3 * last[name]:>16.1f}{last[name] / last['uncached']:>13.2f}"
              f"{r['turns'][-1]['cached_tokens']:>12}{r['tower_runs']:>12}{r['encoder_cache_hits']:>11}"
              f"{r['tower_ms_per_image']:>14.2f}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"preset": args.preset, "shape": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
