"""Prefix-cache reuse for a hybrid (GDN + attention) model: qnext's policy against its peers, same trace, same bytes.

Every policy replays the same requests through the real `cache.CacheManager` (cache/replay: the engine loop,
workloads, and the other engines' policies as `CachePolicy` hooks; cache/replay/peers.py lists what each model
simplifies). belady: a clairvoyant schedule in the same memory (cache/replay/belady.py); bound: an upper bound on
any schedule there (cache/replay/reuse_bound.py); q/belady: qnext's share of belady's reuse. Budgets are in tokens
of KV; one state row costs --snapshot-kv-tokens of them. A second table sweeps qnext's one memory knob, the snapshot
share (`snapshot_memory_fraction`, cache/sizing.py), at fixed total memory.

"gap" = oracle - qnext; the loss table splits it per admission (cache/replay/loop.py): prefix not yet computed by
anyone (requests that start together), KV evicted, KV matched without a snapshot, recompute after preemption. "qnext+Nx" is qnext with a host tier of N times its device cache's KV blocks and snapshot rows
(host RAM on top of the same device bytes; cache/tiers.py). The restart table replays the trace once, carries the
cache's index over as a restart with prefix_cache_dir does, and replays it again. With --restore-model the time to
load N tokens of KV and one snapshot back from the host tier is measured through the engine (CPU), against
recomputing them, with the GPU estimate from bytes over --pcie-gbps.

    python scripts/bench_prefix_cache.py --plot bench_out/prefix_cache.png --json-out bench_out/prefix_cache.json
    python scripts/bench_prefix_cache.py --trace requests.jsonl --in-flight 16 --budgets 300000,1200000
    python scripts/bench_prefix_cache.py --workloads chat --sweep '' --restore-model small --restore-tokens 1024
"""
import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache.replay import (POLICIES, WORKLOADS, ReplaySettings, compare, load_trace,  # noqa: E402
                          ordering_violations, snapshot_share_sweep)
from cache.replay.tiers import host_tier_sweep, restart_replay  # noqa: E402
from cache.sizing import DEFAULT_SNAPSHOT_MEMORY_FRACTION  # noqa: E402
from qnext.optional import optional_import  # noqa: E402

SWEEP_FRACTIONS = [0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9]


def run(args) -> dict:
    if args.trace:
        workloads = {Path(args.trace).stem: load_trace(args.trace)}
    else:
        workloads = {name: WORKLOADS[name](random.Random(args.seed), args.scale) for name in args.workloads}
    settings = ReplaySettings(block_size=args.block_size, in_flight=args.in_flight, chunk=args.chunk,
                              state_kv_tokens=args.snapshot_kv_tokens,
                              snapshot_memory_fraction=args.snapshot_memory_fraction)
    results = compare(workloads, args.budgets, args.policies, settings)
    if args.host_multiples:
        results["host_tier"] = {"multiples": args.host_multiples,
                                "workloads": host_tier_sweep(workloads, args.budgets, args.host_multiples, settings)}
    if args.restart:
        results["restart"] = {name: {str(b): restart_replay(requests, b, settings) for b in args.budgets}
                              for name, requests in workloads.items()}
    if args.restore_model:
        results["restore"] = restore_timing(args.restore_model, args.restore_tokens, args.pcie_gbps)
    if args.sweep:
        results["snapshot_share"] = {"fractions": args.sweep, "default": args.snapshot_memory_fraction,
                                     "workloads": snapshot_share_sweep(workloads, args.budgets, args.sweep, settings)}
    return results


def format_table(results: dict) -> str:
    policies = results["policies"]
    tiers = results.get("host_tier", {})
    multiples = [str(m) for m in tiers.get("multiples", []) if m]
    head = f"{'workload':<15}{'budget':>9} " + "".join(f"{p:>12}" for p in policies)
    head += "".join(f"{'qnext+' + f'{float(m):g}x':>12}" for m in multiples)
    if "oracle" in policies and "qnext" in policies:
        head += f"{'gap':>8}"
    if "belady" in policies and "qnext" in policies:
        head += f"{'q/belady':>10}"
    lines = [head, "-" * len(head)]
    for name, w in results["workloads"].items():
        for budget, row in w["budgets"].items():
            line = f"{name:<15}{_fmt_tokens(int(budget)):>9} " + "".join(
                f"{100 * row[p]['reuse']:>11.1f}%" for p in policies)
            line += "".join(f"{100 * tiers['workloads'][name][budget][m]['reuse']:>11.1f}%" for m in multiples)
            if "oracle" in row and "qnext" in row:
                line += f"{100 * (row['oracle']['reuse'] - row['qnext']['reuse']):>7.1f}%"
            if "belady" in row and "qnext" in row:
                line += f"{row['qnext']['reuse'] / max(row['belady']['reuse'], 1e-9):>10.2f}"
            lines.append(line)
    return "\n".join(lines)


def format_loss(results: dict) -> str:
    """Where qnext's reuse falls short of the oracle's, in % of prompt tokens (cache/replay/loop.py), and the
    oracle's working set in multiples of the budget (cache/replay/compare.py)."""
    head = (f"{'loss vs oracle':<15}{'budget':>9} {'qnext':>8}{'oracle':>8}{'concurrent':>12}{'evicted KV':>12}"
            f"{'no state':>10}{'preempted':>11}{'working set':>13}")
    lines = [head, "-" * len(head)]
    for name, w in results["workloads"].items():
        for budget, row in w["budgets"].items():
            q, pt = row["qnext"], row["qnext"]["prompt_tokens"]
            lost = q["lost"]
            lines.append(f"{name:<15}{_fmt_tokens(int(budget)):>9} {100 * q['reuse']:>7.1f}%"
                         f"{100 * row['oracle']['reuse']:>7.1f}%{100 * lost['concurrent'] / pt:>11.1f}%"
                         f"{100 * lost['evicted_kv'] / pt:>11.1f}%{100 * lost['missing_state'] / pt:>9.1f}%"
                         f"{100 * lost['preempted'] / pt:>10.1f}%{w['oracle_working_set'] / int(budget):>12.2f}x")
    return "\n".join(lines)


def format_restart(restart: dict) -> str:
    """qnext's reuse on a second replay of the trace after a restart that kept the cache (host tier 1x)."""
    head = f"{'restart':<15}{'budget':>9} {'cold':>8}{'after restart':>15}{'no restart':>12}"
    lines = [head, "-" * len(head)]
    for name, per_budget in restart.items():
        for budget, r in per_budget.items():
            lines.append(f"{name:<15}{_fmt_tokens(int(budget)):>9} {100 * r['cold']['reuse']:>7.1f}%"
                         f"{100 * r['after_restart']['reuse']:>14.1f}%{100 * r['same_process']['reuse']:>11.1f}%")
    return "\n".join(lines)


def format_sweep(sweep: dict) -> str:
    """qnext's reuse per snapshot share, and the mean over every workload and budget (steps are in the JSON)."""
    fractions = [str(f) for f in sweep["fractions"]]
    head = f"{'snapshot share':<15}{'budget':>9} " + "".join(f"{f:>8}" for f in fractions)
    lines = [head, "-" * len(head)]
    cells = []
    for name, per_budget in sweep["workloads"].items():
        for budget, row in per_budget.items():
            lines.append(f"{name:<15}{_fmt_tokens(int(budget)):>9} " + "".join(f"{100 * row[f]['reuse']:>7.1f}%"
                                                                              for f in fractions))
            cells.append(row)
    means = {f: sum(c[f]["reuse"] for c in cells) / len(cells) for f in fractions}
    lines.append(f"{'mean':<15}{'':>9} " + "".join(f"{100 * means[f]:>7.1f}%" for f in fractions))
    best = max(means, key=means.get)
    lines.append(f"default snapshot_memory_fraction {sweep['default']}; best mean here {best}")
    return "\n".join(lines)


def _fmt_tokens(n: int) -> str:
    return f"{n // 1000}k" if n < 1_000_000 else f"{n / 1e6:g}M"


def plot(results: dict, path: str) -> None:
    matplotlib = optional_import("matplotlib", "bench", "--plot")
    matplotlib.use("Agg")
    plt = optional_import("matplotlib.pyplot", "bench", "--plot")
    names = list(results["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        budgets = results["workloads"][name]["budgets"]
        xs = [int(b) for b in budgets]
        for policy in results["policies"]:
            ys = [100 * budgets[b][policy]["reuse"] for b in budgets]
            ax.plot(xs, ys, marker="o", label=policy, linestyle="--" if policy == "oracle" else "-")
        ax.set_xscale("log")
        ax.set_xticks(xs, [_fmt_tokens(x) for x in xs])
        ax.minorticks_off()
        ax.set_title(name)
        ax.set_xlabel("memory budget (KV tokens)")
        ax.set_ylim(min(0, ax.get_ylim()[0]), 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("prompt tokens reused (%)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def restore_timing(model: str, lengths: list[int], pcie_gbps: float) -> dict:
    """Per prompt length N (a multiple of 64): time to first token of an (N+1)-token prompt computed cold, loaded
    back from the host tier (N tokens of KV and one snapshot, then 1 token computed), and served from the device
    cache; the copies' own time and bytes from the cache's tier counters; the same bytes over PCIe at `pcie_gbps`.
    Through the engine on this machine, each path run once before it is timed (no compilation is timed)."""
    import tempfile

    import numpy as np

    from qnext.bench.presets import PRESETS, bench_checkpoint
    from qnext.engine.llm_engine import LLMEngine
    from qnext.sampling_params import SamplingParams

    bs, longest = 64, max(lengths)
    engine = LLMEngine(bench_checkpoint(model, Path(tempfile.gettempdir()) / "qnext-bench"), max_num_seqs=1,
                       max_num_batched_tokens=PRESETS[model].max_num_batched_tokens, max_model_len=longest + bs,
                       block_size=bs, num_gpu_blocks_override=2 * longest // bs + 2, max_num_snapshots=4,
                       kv_offloading_size=0.25)
    cache, host, params = engine.cache.manager, engine.cache.host_buffers, SamplingParams(max_tokens=1)
    rng, out = np.random.default_rng(0), {"model": model, "pcie_gbps": pcie_gbps, "lengths": {}}

    def ttft(prompt) -> float:
        t0 = time.perf_counter()
        engine.add_request(str(t0), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
        engine.release(str(t0))
        return time.perf_counter() - t0

    def offload_everything():             # what eviction under memory pressure would do, and its copies
        cache.evict_cached_blocks(cache.config.num_blocks)
        while cache.snapshots.evict_lru() is not None:
            pass
        engine.cache.flush_transfers()

    for n in lengths:
        for timed in (False, True):
            prompt = rng.integers(3, engine.model_config.vocab_size, n + 1).tolist()
            cold = ttft(prompt)
            offload_everything()
            t = dataclasses.replace(cache.stats.tiers)
            from_host = ttft(prompt)
            copy_s, copied = cache.stats.tiers.seconds_to_device - t.seconds_to_device, \
                cache.stats.tiers.bytes_to_device - t.bytes_to_device
            from_device = ttft(prompt)
        restored = n // bs * host.block_bytes() + host.row_bytes()
        assert copied == restored, (copied, restored)
        out["lengths"][str(n)] = {"cold_s": cold, "from_host_s": from_host, "from_device_s": from_device,
                                  "copy_s": copy_s, "bytes": copied, "gpu_copy_s": copied / (pcie_gbps * 1e9)}
    return out


def format_restore(restore: dict) -> str:
    head = (f"{'restore (' + restore['model'] + ')':<22}{'cold TTFT':>10}{'host hit':>10}{'device hit':>11}"
            f"{'copy':>9}{'bytes':>10}{'GPU copy @' + format(restore['pcie_gbps'], 'g') + ' GB/s':>20}")
    lines = [head, "-" * len(head)]
    for n, r in restore["lengths"].items():
        lines.append(f"{n + ' tokens':<22}{1e3 * r['cold_s']:>8.1f}ms{1e3 * r['from_host_s']:>8.1f}ms"
                     f"{1e3 * r['from_device_s']:>9.1f}ms{1e3 * r['copy_s']:>7.1f}ms{r['bytes'] / 2**20:>7.1f}MiB"
                     f"{1e3 * r['gpu_copy_s']:>18.2f}ms")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--trace", help="JSONL trace replayed instead of the built-in workloads")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--budgets", type=_ints, default=[150_000, 300_000, 600_000, 1_200_000],
                   help="total memory budgets in KV tokens, comma separated")
    p.add_argument("--snapshot-kv-tokens", type=int, default=3000,
                   help="memory of one state row in KV tokens (Qwen3-Next-80B: ~3000)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--in-flight", type=int, default=8, help="requests running at once")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk in tokens")
    p.add_argument("--snapshot-memory-fraction", type=float, default=DEFAULT_SNAPSHOT_MEMORY_FRACTION,
                   help="qnext's share of the memory after the live rows that snapshot rows may take")
    p.add_argument("--sweep", type=_floats, default=SWEEP_FRACTIONS,
                   help="snapshot shares for the trade-off table, comma separated ('' to skip)")
    p.add_argument("--host-multiples", type=_floats, default=[1.0, 4.0],
                   help="qnext host tiers to replay, in multiples of its device cache ('' to skip)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="replay each trace again after a restart that kept the cache")
    p.add_argument("--restore-model", choices=["tiny", "tiny-next", "small"],
                   help="measure loading KV + a snapshot back from the host tier vs recomputing (engine, CPU)")
    p.add_argument("--restore-tokens", type=_ints, default=[256, 1024], help="prompt lengths for --restore-model")
    p.add_argument("--pcie-gbps", type=float, default=25.0, help="host <-> GPU bandwidth per direction, GB/s")
    p.add_argument("--scale", type=float, default=1.0, help="workload size multiplier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    p.add_argument("--plot", help="PNG path for reuse vs budget")
    return p.parse_args(argv)


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",")]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    results = run(args)
    results["seconds"] = round(time.perf_counter() - t0, 2)
    results["args"] = dict(vars(args))
    print(format_table(results))
    if "qnext" in results["policies"] and "oracle" in results["policies"]:
        print("\n" + format_loss(results))
    if "restart" in results:
        print("\n" + format_restart(results["restart"]))
    if "restore" in results:
        print("\n" + format_restore(results["restore"]))
    if "snapshot_share" in results:
        print("\n" + format_sweep(results["snapshot_share"]))
    bad = ordering_violations(results)
    print(f"\n{results['seconds']} s; " + ("qnext reuses at least as much as every online policy everywhere"
                                          if not bad else "qnext loses: " + "; ".join(bad)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
