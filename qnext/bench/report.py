"""scripts/bench.py's report: the floors each row is held against, the targets, the printed table and the plot."""
from __future__ import annotations

import numpy as np

from qnext.optional import optional_import


def set_floors(row: dict, fl: dict) -> None:
    """The row's floors (qnext/bench/bandwidth.py: floors) and each engine's share of them."""
    q, h, tokens = row["qnext"], row.get("hf"), row["batch"] * row["output_len"]
    row.update(floor=fl, floor_seconds=fl["seconds"], floor_output_tokens_per_s=tokens / fl["seconds"],
               gemm_floor_output_tokens_per_s=tokens / fl["gemm_seconds"],
               bandwidth_floor_output_tokens_per_s=tokens / fl["bandwidth_seconds"])
    q["fraction_of_floor"] = fl["seconds"] / q["seconds"]
    step = q["host_full_decode"].get("step_s")
    q["decode_fraction_of_floor"] = fl["decode_step_s"] / step if step else None
    q["decode_fraction_of_bandwidth_floor"] = fl["decode_step_bandwidth_s"] / step if step else None
    fastest = q["host_full_decode"].get("step_s_fastest_call")
    q["decode_fraction_of_bandwidth_floor_fastest_call"] = fl["decode_step_bandwidth_s"] / fastest if fastest else None
    if h:
        h["fraction_of_floor"] = fl["seconds"] / h["seconds"]
        row["floor_over_hf"] = row["floor_output_tokens_per_s"] / h["output_tokens_per_s"]


def fmt_s(x):
    return "-" if x is None or x != x else (f"{x * 1e3:.1f}ms" if x < 1 else f"{x:.2f}s")


def targets(results: list[dict]) -> list[dict]:
    out = []
    by = {r["model"]: r for r in results}

    def row(model, batch):
        return next((o for o in by.get(model, {}).get("offline", []) if o["batch"] == batch), None)

    small16 = row("small", 16)
    if small16 and "ratio" in small16:
        r, f = small16["ratio"]["throughput"], small16["qnext"]["fraction_of_floor"]
        out.append({"target": "small b16 throughput >= 2x transformers", "value": r, "met": r >= 2,
                    "needs_fraction_of_floor": 2 / small16["floor_over_hf"]})
        out.append({"target": "small b16 throughput >= 60% of the floor", "value": f, "met": f >= 0.6})
    small1 = row("small", 1)
    if small1 and small1["qnext"].get("decode_fraction_of_bandwidth_floor"):
        f = small1["qnext"]["decode_fraction_of_bandwidth_floor"]
        out.append({"target": "small b1 decode step (mean) >= 85% of the bandwidth floor", "value": f, "met": f >= 0.85})
        f = small1["qnext"]["decode_fraction_of_bandwidth_floor_fastest_call"]
        out.append({"target": "small b1 decode step (fastest call) >= 85% of the bandwidth floor", "value": f,
                    "met": f >= 0.85})
    for b in (16, 64):
        t = row("tiny", b)
        if t and "ratio" in t:
            r = t["ratio"]["throughput"]
            out.append({"target": f"tiny b{b} throughput >= 10x transformers", "value": r, "met": r >= 10,
                        "needs_fraction_of_floor": 10 / t["floor_over_hf"]})
    for name in ("small", "tiny"):
        chat = by.get(name, {}).get("chat")
        if chat and len(chat["turns"]) >= 4:
            r = chat["turns"][3]["ttft_ratio"]
            out.append({"target": f"{name} chat turn-4 TTFT cached <= 0.3x uncached", "value": r, "met": r <= 0.3})
    host = by.get("small", {}).get("host", {}).get("64")
    if host:
        out.append({"target": "small b64 host time per step < 5%", "value": host["host_fraction"],
                    "met": host["host_fraction"] < 0.05})
    return out


def print_report(report: dict) -> None:
    print()
    print(f"qnext bench  dtype={report['dtype']}  {report['machine']}  (JAX compilation excluded: warm-up passes of "
          "the same shapes, no step compiled while timed)")
    for r in report["results"]:
        g = r["gemm"]
        rates = "  ".join(f"M={m}: fp32 {v['float32']['flops_per_s'] / 1e9:.0f} / bf16 "
                          f"{v['bfloat16']['flops_per_s'] / 1e9:.0f}" for m, v in g.items())
        bw = r["bandwidth"]
        err = r.get("logit_error_vs_float32")
        if err:
            print(f"\n{r['model']} {report['dtype']} logits against float32 ({err['tokens']} positions): max abs "
                  f"{err['max_abs']:.3g}, RMS {err['rms_abs']:.3g} ({100 * err['rms_relative']:.1f}% of the logits' "
                  f"RMS), greedy token agrees at {100 * err['argmax_agreement']:.1f}%")
        print(f"\n== {r['model']} ({r['family']}, {r['flops_per_token_matmul'] / 1e6:.1f} MFLOP/token in matmuls)"
              f"  GEMM GFLOP/s at the model's shapes: {rates}  memory bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s "
              f"({bw['reader']})")
        print(f"{'batch':>5} {'qnext tok/s':>11} {'hf tok/s':>9} {'x hf':>6} {'GEMM floor':>10} {'BW floor':>9} "
              f"{'%floor':>6} {'TTFT q':>8} {'TTFT hf':>8} {'TPOT q':>8} {'TPOT hf':>8} {'step q':>8} "
              f"{'GEMM fl':>8} {'BW fl':>8} {'%GEMM':>5} {'%BW':>5} {'host%':>6} {'agree':>6}")
        for o in r["offline"]:
            q, h, fl = o["qnext"], o.get("hf"), o["floor"]
            host = q["host_full_decode"] or q["host_all_steps"]
            step = q["host_full_decode"].get("step_s") or float("nan")
            print(f"{o['batch']:>5} {q['output_tokens_per_s']:>11.1f} "
                  f"{(h['output_tokens_per_s'] if h else float('nan')):>9.1f} "
                  f"{(o['ratio']['throughput'] if h else float('nan')):>6.2f} "
                  f"{o['gemm_floor_output_tokens_per_s']:>10.1f} {o['bandwidth_floor_output_tokens_per_s']:>9.1f} "
                  f"{100 * q['fraction_of_floor']:>5.0f}% {fmt_s(np.mean(q['ttft_s'])):>8} "
                  f"{fmt_s(np.mean(h['ttft_s']) if h else None):>8} {fmt_s(np.mean(q['tpot_s'])):>8} "
                  f"{fmt_s(np.mean(h['tpot_s']) if h else None):>8} {fmt_s(step):>8} "
                  f"{fmt_s(fl['decode_step_gemm_s']):>8} {fmt_s(fl['decode_step_bandwidth_s']):>8} "
                  f"{100 * fl['decode_step_gemm_s'] / step:>4.0f}% {100 * fl['decode_step_bandwidth_s'] / step:>4.0f}% "
                  f"{100 * host['host_fraction']:>5.1f}% "
                  f"{(100 * o['agreement']['identical_outputs'] if h else float('nan')):>5.0f}%")
        print("  GEMM / BW floor: tok/s at this machine's GEMM rate / memory bandwidth; %floor: of the slower of the "
              "two in each phase; step q: one decode step of every row, and its two floors (GEMM fl, BW fl)")
        for o in r["offline"]:
            one = o.get("qnext_one_step_per_call")
            if one:
                print(f"  batch {o['batch']}: one decode step per call {one['output_tokens_per_s']:.1f} tok/s (TPOT "
                      f"{fmt_s(one['tpot_s'])}), {report['args']['num_scheduler_steps']} steps per call "
                      f"{o['qnext']['output_tokens_per_s']:.1f} "
                      f"({o['multi_step_speedup']:.2f}x), same tokens: {one['same_tokens']}")
        for b, host in r["host"].items():
            if host:
                print(f"  host per decode step at batch {b}: step {fmt_s(host['step_s'])} (fastest call of "
                      f"{host['steps_per_call']}: {fmt_s(host['step_s_fastest_call'])} a step), jitted step "
                      f"{fmt_s(host['device_s'])}, outside it {fmt_s(host['host_s'])} "
                      f"({100 * host['host_fraction']:.1f}%: schedule {fmt_s(host['schedule_s'])}, layout "
                      f"{fmt_s(host['layout_s'])}, sample {fmt_s(host['sample_s'])}, postprocess "
                      f"{fmt_s(host['postprocess_s'])})")
        chat = r.get("chat")
        if chat:
            print(f"  multi-turn chat ({chat['chats']} chats, median TTFT per turn, one request at a time):")
            print(f"  {'turn':>4} {'prompt':>6} {'TTFT on':>8} {'TTFT off':>8} {'on/off':>6} {'reused':>6} "
                  f"{'lost':>5} {'same':>5}")
            for t in chat["turns"]:
                print(f"  {t['turn']:>4} {t['prompt_len']:>6.0f} {fmt_s(t['ttft_on_s']):>8} "
                      f"{fmt_s(t['ttft_off_s']):>8} {t['ttft_ratio']:>6.2f} {t['reused_tokens']:>6} "
                      f"{t['lost_to_missing_state_tokens']:>5} {100 * t['same_output']:>4.0f}%")
    if report["targets"]:
        print("\ntargets:")
        for t in report["targets"]:
            needs = t.get("needs_fraction_of_floor")
            needs = f" (that needs {100 * needs:.0f}% of the floor)" if needs else ""
            print(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['value']:.3g}{needs}")
    print(f"\ntotal bench time {report['seconds']:.0f}s")


def plot(report: dict, path: str) -> None:
    matplotlib = optional_import("matplotlib", "bench", "--plot")
    matplotlib.use("Agg")
    plt = optional_import("matplotlib.pyplot", "bench", "--plot")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(report["results"]):
        c = colors[i % len(colors)]
        rows = r["offline"]
        ax1.plot([o["batch"] for o in rows], [o["qnext"]["output_tokens_per_s"] for o in rows], "o-", color=c,
                 label=f"qnext {r['model']}")
        hf = [o for o in rows if "hf" in o]
        if hf:
            ax1.plot([o["batch"] for o in hf], [o["hf"]["output_tokens_per_s"] for o in hf], "s--", color=c,
                     label=f"transformers {r['model']}")
        ax1.plot([o["batch"] for o in rows], [o["floor_output_tokens_per_s"] for o in rows], ":", color=c,
                 label=f"floor {r['model']} (GEMM or bandwidth)")
        chat = r.get("chat")
        if chat:
            turns = [t["turn"] for t in chat["turns"]]
            ax2.plot(turns, [t["ttft_off_s"] * 1e3 for t in chat["turns"]], "s--", color=c,
                     label=f"{r['model']} cache off")
            ax2.plot(turns, [t["ttft_on_s"] * 1e3 for t in chat["turns"]], "o-", color=c,
                     label=f"{r['model']} cache on")
            ax2.set_xticks(turns)
    ax1.set(xscale="log", yscale="log", xlabel="batch (prompts at once)", ylabel="output tokens/s",
            title=f"offline throughput ({report['dtype']})")
    ax2.set(yscale="log", xlabel="chat turn", ylabel="TTFT (ms)", title="multi-turn chat TTFT, prefix caching")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
