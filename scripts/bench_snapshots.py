"""Narrow device snapshot rows (`mamba_ssm_cache_dtype="bfloat16"`, docs/fp8.md) against float32 ones, same run:

    python scripts/bench_snapshots.py                  # rows at a fixed budget, then the step time
    python scripts/bench_snapshots.py --parts rows

rows: the snapshot rows the cache sizing gives at a fixed byte budget (small preset, 1 GiB, max_num_seqs 16; the
flagship's FP8 plans from scripts/scale_plan.py, 8 x H100 and 8 x H200).
step: the small preset in bf16, multi-turn chats whose later turns restore a snapshot and capture new ones; each
engine's fastest of --repeats alternating passes (wall seconds, and the model step's device seconds per step).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DTYPES = ("auto", "bfloat16")


def rows_table() -> list[tuple[str, dict]]:
    from cache.sizing import GIB
    from qnext.bench.presets import PRESETS
    from qnext.config import ModelConfig
    from qnext.engine.cache_setup import cache_sizes
    from qnext.engine.config import EngineConfig
    from qnext.model.tensor_parallel import parallel_config
    from qnext.testing.tiny_checkpoint import tiny_hf_config
    from scripts.scale_plan import FLAGSHIP

    preset = PRESETS["small"]
    small = ModelConfig.from_hf_config(tiny_hf_config(preset.family, **preset.overrides))
    flagship = parallel_config(ModelConfig.from_hf_config(FLAGSHIP), 8)
    models = {"small, 1 GiB, max_num_seqs 16": (small, 1, GIB, 16, "auto"),
              "397B-A17B FP8 TP8, 8 x H100 (19.44 GiB)": (flagship, 8, int(19.44 * GIB), 256, "fp8"),
              "397B-A17B FP8 TP8, 8 x H200 (73.44 GiB)": (flagship, 8, int(73.44 * GIB), 256, "fp8")}
    out = []
    for name, (cfg, tp, budget, seqs, kv) in models.items():
        sizes = {d: cache_sizes(cfg, EngineConfig(dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=seqs,
                                                  max_model_len=32768, kv_cache_memory_bytes=budget,
                                                  kv_cache_dtype=kv, mamba_ssm_cache_dtype=d), 32768)
                 for d in DTYPES}
        out.append((name, sizes))
    return out


def step_times(root: Path, repeats: int, chats: int = 8, turns: int = 3) -> dict[str, dict]:
    import qnext
    from qnext import SamplingParams
    from qnext.bench.presets import bench_checkpoint

    path = bench_checkpoint("small", root)
    engines = {d: qnext.LLM(path, dtype="bfloat16", max_num_seqs=chats, max_model_len=1024,
                            kv_cache_memory_bytes=256 << 20, mamba_ssm_cache_dtype=d) for d in DTYPES}
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def one_pass(llm, seed):
        rng = np.random.default_rng(seed)
        histories = [rng.integers(3, 8000, 200).tolist() for _ in range(chats)]
        before = (llm.engine.stats.device_seconds, llm.engine.stats.num_model_steps,
                  llm.engine.cache_stats.snapshots_restored)
        start = time.perf_counter()
        for _ in range(turns):
            outs = llm.generate([{"prompt_token_ids": h} for h in histories], greedy)
            histories = [h + list(o.outputs[0].token_ids) + rng.integers(3, 8000, 32).tolist()
                         for h, o in zip(histories, outs)]
        wall = time.perf_counter() - start
        s = llm.engine.stats
        return {"wall_s": wall, "ms_per_step": 1e3 * (s.device_seconds - before[0]) / (s.num_model_steps - before[1]),
                "steps": s.num_model_steps - before[1],
                "restored": llm.engine.cache_stats.snapshots_restored - before[2]}

    for i, llm in enumerate(engines.values()):        # compiles every shape the workload meets
        one_pass(llm, 100 + i)
    best: dict[str, dict] = {}
    for r in range(repeats):
        for d, llm in engines.items():
            got = one_pass(llm, r)
            if d not in best or got["wall_s"] < best[d]["wall_s"]:
                best[d] = got
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="rows,step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--root", default=None, help="where the preset checkpoint goes (default: a temporary directory)")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if "rows" in parts:
        print("| budget | snapshot rows f32 | snapshot rows bf16 | ratio | KV tokens f32 | KV tokens bf16 |\n"
              "|---|---|---|---|---|---|")
        for name, s in rows_table():
            f, b = s["auto"], s["bfloat16"]
            print(f"| {name} | {f.num_snapshot_rows} | {b.num_snapshot_rows} | "
                  f"{b.num_snapshot_rows / f.num_snapshot_rows:.2f}x | {f.num_blocks * f.block_size} | "
                  f"{b.num_blocks * b.block_size} |")
    if "step" in parts:
        root = Path(args.root or tempfile.mkdtemp(prefix="qnext-snapshots-"))
        print("\n| small, snapshots | wall s (fastest pass) | ms per model step | model steps | restored |\n"
              "|---|---|---|---|---|")
        for d, r in step_times(root, args.repeats).items():
            print(f"| {'float32' if d == 'auto' else d} | {r['wall_s']:.2f} | {r['ms_per_step']:.1f} | "
                  f"{r['steps']} | {r['restored']} |")


if __name__ == "__main__":
    main()
