import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_prefix_cache.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_small_bench_qnext_reuses_at_least_as_much_as_every_peer():
    bench = load_bench()
    args = bench.parse_args(["--scale", "0.3", "--budgets", "60000,150000,600000", "--in-flight", "4"])
    results = bench.run(args)
    assert bench.ordering_violations(results) == []
    rows = [row for w in results["workloads"].values() for row in w["budgets"].values()]
    assert all(row["kv-only"]["reuse"] <= 0 for row in rows)  # KV alone is useless for a hybrid model
    assert any(row["qnext"]["reuse"] > row["sglang"]["reuse"] + 0.05 for row in rows)
    assert all(row["qnext"]["reuse"] > 0.4 for row in rows)


def test_trace_replay_writes_json_and_plot(tmp_path):
    bench = load_bench()
    shared = list(range(1, 700))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_token_ids": shared + [1000 + i] * 30,
                                           "output_token_ids": [7] * 40}) for i in range(12)))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = bench.main(["--trace", str(trace), "--budgets", "60000", "--in-flight", "2",
                     "--json-out", str(out), "--plot", str(png)])
    res = json.loads(out.read_text())
    row = res["workloads"]["t"]["budgets"]["60000"]
    assert rc == 0 and png.stat().st_size > 0
    assert row["qnext"]["reuse"] > 0.5 and row["qnext"]["prompt_tokens"] == 12 * 729
