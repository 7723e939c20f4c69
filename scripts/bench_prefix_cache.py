"""Prefix-cache reuse for a hybrid (GDN + attention) model: qnext's policy against its peers, same trace, same bytes.

Every policy replays the same requests through the real `cache.CacheManager` (cache/replay: the engine loop,
workloads, and the other engines' policies as `CachePolicy` hooks; cache/replay/peers.py lists what each model
simplifies). Budgets are in tokens of KV; one state row costs --snapshot-kv-tokens of them. A second table sweeps
qnext's one memory knob, the snapshot share (`snapshot_memory_fraction`, cache/sizing.py), at fixed total memory.

"gap" = oracle - qnext; it includes the --in-flight requests that start together at the beginning, before any of
them can publish.

    python scripts/bench_prefix_cache.py --plot bench_out/prefix_cache.png --json-out bench_out/prefix_cache.json
    python scripts/bench_prefix_cache.py --trace requests.jsonl --in-flight 16 --budgets 300000,1200000
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache.replay import (POLICIES, WORKLOADS, ReplaySettings, compare, load_trace,  # noqa: E402
                          ordering_violations, snapshot_share_sweep)
from cache.sizing import DEFAULT_SNAPSHOT_MEMORY_FRACTION  # noqa: E402

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
    if args.sweep:
        results["snapshot_share"] = {"fractions": args.sweep, "default": args.snapshot_memory_fraction,
                                     "workloads": snapshot_share_sweep(workloads, args.budgets, args.sweep, settings)}
    return results


def format_table(results: dict) -> str:
    policies = results["policies"]
    head = f"{'workload':<15}{'budget':>9} " + "".join(f"{p:>12}" for p in policies)
    if "oracle" in policies and "qnext" in policies:
        head += f"{'gap':>8}"
    lines = [head, "-" * len(head)]
    for name, w in results["workloads"].items():
        for budget, row in w["budgets"].items():
            line = f"{name:<15}{_fmt_tokens(int(budget)):>9} " + "".join(
                f"{100 * row[p]['reuse']:>11.1f}%" for p in policies)
            if "oracle" in row and "qnext" in row:
                line += f"{100 * (row['oracle']['reuse'] - row['qnext']['reuse']):>7.1f}%"
            lines.append(line)
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    if "snapshot_share" in results:
        print("\n" + format_sweep(results["snapshot_share"]))
    bad = ordering_violations(results)
    print(f"\n{results['seconds']} s; " + ("qnext reuses at least as much as every non-oracle policy everywhere"
                                          if not bad else "qnext loses: " + "; ".join(bad)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
