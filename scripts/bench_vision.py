"""Vision serving: a 4-turn chat with 2 pictures a turn on a preset's text model plus a tiny tower (docs/vision.md,
"Serving"): the 4th turn's time to first token with the prefix cache against without it, the encoder cache's hits
and the tower's time per picture. Three configurations, each on its own engine, the same measured chat:

- cached: prefix cache (image-aware block hashes, snapshot before each <|vision_start|>) and encoder cache;
- encoder cache only: no prefix cache, so every turn recomputes its prompt, but resent pictures skip the tower;
- uncached: neither.

The engines are built and warmed up first (the whole chat once, with other pictures, compiles every shape); then
the measured chats run turn by turn in turns across the three engines (a shared machine's load hits them alike),
--repeats times with new pictures each time; TTFT is the median over the repeats.

    python scripts/bench_vision.py                          # small preset, 128x128 pictures (256 tokens each)
    python scripts/bench_vision.py --preset tiny --json-out bench_out/vision.json
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qnext.bench.presets import PRESETS  # noqa: E402
import numpy as np  # noqa: E402

from qnext.bench.vision_chat import ChatShape, run_interleaved, vision_checkpoint  # noqa: E402

CONFIGS = {"cached": dict(enable_prefix_caching=True),
           "encoder cache only": dict(enable_prefix_caching=False),
           "uncached": dict(enable_prefix_caching=False, encoder_cache_bytes=0)}


def measure(path: Path, engine_options: dict, shape: ChatShape, repeats: int) -> dict:
    from qnext.engine.llm_engine import LLMEngine

    engines = {name: LLMEngine(path, **engine_options, **options) for name, options in CONFIGS.items()}
    run_interleaved(engines, shape, seed=0)           # compiles every shape; its pictures are not reused below
    before = {name: dataclasses.replace(e.stats) for name, e in engines.items()}
    runs = [run_interleaved(engines, shape, seed=1 + r) for r in range(repeats)]
    results = {}
    for name, engine in engines.items():
        s, b = engine.stats, before[name]
        towers = s.num_tower_runs - b.num_tower_runs
        turns = [dict(runs[0][name][t], ttft_s=float(np.median([run[name][t]["ttft_s"] for run in runs])))
                 for t in range(shape.turns)]
        results[name] = {"turns": turns, "tower_runs": towers / repeats,
                         "tower_ms_per_image": 1e3 * (s.tower_seconds - b.tower_seconds) / max(1, towers),
                         "encoder_cache_hits": (s.num_encoder_cache_hits - b.num_encoder_cache_hits) / repeats}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--root", default="bench_out/checkpoints", help="where the preset's checkpoint is written")
    ap.add_argument("--image-side", type=int, default=128, help="picture side in pixels ((side / 8)^2 tokens)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--images-per-turn", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="measured chats (new pictures each); TTFT: the median")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    shape = ChatShape(turns=args.turns, images_per_turn=args.images_per_turn, image_side=args.image_side)
    path = vision_checkpoint(args.preset, args.root, args.image_side)
    engine_options = dict(max_model_len=4096, max_num_seqs=4,
                          max_num_batched_tokens=PRESETS[args.preset].max_num_batched_tokens)
    results = measure(path, engine_options, shape, args.repeats)
    last = {name: r["turns"][-1]["ttft_s"] for name, r in results.items()}
    print(f"{args.preset} + tiny tower, {args.turns} turns x {args.images_per_turn} pictures of "
          f"{(args.image_side // 8) ** 2} tokens; median of {args.repeats}; turn {args.turns} prompt "
          f"{results['cached']['turns'][-1]['prompt_tokens']} tokens")
    print(f"{'configuration':<20}{'turn-4 TTFT ms':>16}{'vs uncached':>13}{'cached tok':>12}{'tower runs':>12}"
          f"{'enc. hits':>11}{'tower ms/img':>14}")
    for name, r in results.items():
        print(f"{name:<20}{1e3 * last[name]:>16.1f}{last[name] / last['uncached']:>13.2f}"
              f"{r['turns'][-1]['cached_tokens']:>12}{r['tower_runs']:>12g}{r['encoder_cache_hits']:>11g}"
              f"{r['tower_ms_per_image']:>14.2f}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"preset": args.preset, "shape": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
