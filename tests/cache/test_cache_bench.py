import json
import random
import subprocess
import sys
from pathlib import Path

from cache.policy import CachePolicy
from cache.replay import (WORKLOADS, ReplaySettings, build_manager, compare, ordering_violations, replay,
                          snapshot_share_sweep)

ROOT = Path(__file__).resolve().parents[2]
SMALL = ReplaySettings(in_flight=4)


def small_workloads():
    return {name: make(random.Random(0), 0.3) for name, make in WORKLOADS.items()}


def test_small_bench_qnext_reuses_at_least_as_much_as_every_peer():
    results = compare(small_workloads(), [60_000, 150_000, 600_000], settings=SMALL)
    assert ordering_violations(results) == []
    rows = [row for w in results["workloads"].values() for row in w["budgets"].values()]
    assert all(row["kv-only"]["reuse"] <= 0 for row in rows)  # KV alone is useless for a hybrid model
    assert any(row["qnext"]["reuse"] > row["sglang"]["reuse"] + 0.05 for row in rows)
    assert all(row["qnext"]["reuse"] > 0.4 for row in rows)


def test_snapshot_share_sweep_trades_kv_for_snapshot_rows_at_fixed_memory():
    workloads = {"chat": small_workloads()["chat"]}
    sweep = snapshot_share_sweep(workloads, [150_000], [0.0, 0.75], SMALL)["chat"]["150000"]
    assert sweep["0.0"]["reuse"] == 0.0 and sweep["0.75"]["reuse"] > 0.4  # no snapshot rows: nothing reusable


def test_trace_replay_writes_json_and_plot(tmp_path):
    shared = list(range(1, 700))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_token_ids": shared + [1000 + i] * 30,
                                           "output_token_ids": [7] * 40}) for i in range(12)))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_prefix_cache.py"), "--trace", str(trace),
                           "--budgets", "60000", "--in-flight", "2", "--sweep", "0.5,0.75",
                           "--json-out", str(out), "--plot", str(png)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    row = res["workloads"]["t"]["budgets"]["60000"]
    assert png.stat().st_size > 0 and "snapshot share" in proc.stdout
    assert row["qnext"]["reuse"] > 0.5 and row["qnext"]["prompt_tokens"] == 12 * 729
    assert set(res["snapshot_share"]["workloads"]["t"]["60000"]) == {"0.5", "0.75"}


def test_qnext_reuses_nine_tenths_of_the_oracle_where_the_oracle_working_set_fits_the_budget():
    results = compare(small_workloads(), [60_000, 150_000, 600_000], ("qnext", "oracle"), SMALL)
    checked = 0
    for w in results["workloads"].values():
        for budget, row in w["budgets"].items():
            if w["oracle_working_set"] <= int(budget):
                assert row["qnext"]["reuse"] >= 0.9 * row["oracle"]["reuse"], (budget, row["qnext"]["lost"])
                checked += 1
    assert checked >= 10


def test_loss_split_puts_requests_that_start_together_under_concurrent():
    """Without waiting for a sibling the long document is computed once per request that starts before any has
    published it: the whole gap to the oracle is `concurrent`; waiting closes it."""
    requests = small_workloads()["long-document"]
    oracle = replay(build_manager("oracle", 0, SMALL, requests), requests, 1, SMALL.chunk)
    reused = {}
    for wait in (0, CachePolicy.sibling_wait_tokens):
        mgr = build_manager("qnext", 600_000, SMALL, requests)
        mgr.policy.sibling_wait_tokens = wait
        r = replay(mgr, requests, SMALL.in_flight, SMALL.chunk)
        reused[wait] = r["reused_tokens"]
        assert r["lost"]["concurrent"] == oracle["reused_tokens"] - r["reused_tokens"]
        assert r["lost"]["evicted_kv"] == r["lost"]["missing_state"] == r["lost"]["preempted"] == 0
    assert reused[0] < reused[CachePolicy.sibling_wait_tokens] == oracle["reused_tokens"]
