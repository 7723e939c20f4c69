"""scripts/bench.py --quick runs end to end and its JSON carries every figure the README table is built from."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])    # bfloat16: the GPU run's dtype, here on CPU
def test_bench_quick_writes_json_and_plot(tmp_path, dtype):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--dtype", dtype,
                           "--out-dir", str(tmp_path / "bench_out"), "--json-out", str(out), "--plot", str(png)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batch qnext tok/s" in proc.stdout
    assert png.stat().st_size > 0

    report = json.loads(out.read_text())
    assert {"dtype", "machine", "results", "targets", "seconds"} <= report.keys()
    assert report["dtype"] == dtype
    (tiny,) = report["results"]
    assert tiny["model"] == "tiny"
    assert {"gemm", "offline", "host", "chat", "flops_per_token_matmul", "engine_options", "compile"} <= tiny.keys()
    assert [row["batch"] for row in tiny["offline"]] == [1, 4]
    assert tiny["bandwidth"]["bytes_per_s"] > 0 and tiny["bandwidth"]["bytes"] > 0
    assert ("logit_error_vs_float32" in tiny) == (dtype != "float32")
    if dtype != "float32":
        assert 0 < tiny["logit_error_vs_float32"]["rms_relative"] < 0.1
    for row in tiny["offline"]:
        q = row["qnext"]
        assert q["compilations"] == 0, "a step shape compiled while timed"
        assert q["output_tokens_per_s"] > 0 and len(q["ttft_s"]) == row["batch"] == len(q["tpot_s"])
        assert 0 < q["fraction_of_floor"] and row["floor_output_tokens_per_s"] > 0
        assert row["flops"]["prefill"] > 0 and row["flops"]["decode"] > 0
        # both floors; the reported one is the slower of the two in each phase
        floor = row["floor"]
        assert row["gemm_floor_output_tokens_per_s"] > 0 and row["bandwidth_floor_output_tokens_per_s"] > 0
        assert floor["seconds"] >= max(floor["gemm_seconds"], floor["bandwidth_seconds"]) * (1 - 1e-9)
        assert floor["decode_step_s"] == max(floor["decode_step_gemm_s"], floor["decode_step_bandwidth_s"])
        assert 0 < q["decode_fraction_of_bandwidth_floor"] and row["bytes"]["decode"] > 0
        host = q["host_full_decode"]
        assert 0 <= host["host_fraction"] < 1 and host["device_s"] > 0
        assert 0 < host["step_s_fastest_call"] <= host["step_s"] * (1 + 1e-9)
        assert q["decode_fraction_of_bandwidth_floor_fastest_call"] >= q["decode_fraction_of_bandwidth_floor"]
    for rates in tiny["gemm"].values():
        assert rates["float32"]["flops_per_s"] > 0 and rates["bfloat16"]["flops_per_s"] > 0

    chat = tiny["chat"]
    assert chat["compilations_while_timed"] == 0
    first, second = chat["turns"]
    assert first["reused_tokens"] == 0 and second["reused_tokens"] > 0
    assert second["same_output"] == 1.0, "prefix caching changed the greedy output"
    assert {"ttft_on_s", "ttft_off_s", "ttft_ratio", "lost_to_missing_state_tokens"} <= second.keys()


def test_bench_transformers_driver_matches_qnext_token_for_token(tmp_path):
    """The bench's transformers run follows ignore_eos as qnext does (EOS neither stops nor is masked) and makes
    exactly output_len tokens, so its greedy outputs can be compared with qnext's: on the bench's own tiny batch-1
    prompt, where the argmax is an EOS id at token 46, both engines agree on all 64 tokens."""
    import numpy as np
    import pytest

    pytest.importorskip("transformers")
    import qnext
    from qnext import SamplingParams
    from qnext.bench.presets import bench_checkpoint

    from qnext.bench.transformers_driver import load_hf, random_prompts, run_hf

    path = bench_checkpoint("tiny", tmp_path)
    prompts = random_prompts(np.random.default_rng(0), 1, (64, 256), 512)     # the bench's batch-1 draw
    hf = run_hf(load_hf(path, "float32", 2), prompts, 64, pad_id=0)["tokens"]
    llm = qnext.LLM(path, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=384)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompts[0]}, greedy)
    assert len(hf[0]) == 64
    assert out[0].outputs[0].token_ids == hf[0]


def test_small_248k_is_small_with_qwen35_vocabulary():
    """The real-vocabulary preset changes only the vocabulary (and ties the embedding to the lm_head), so its
    figures beside `small`'s say what the vocabulary costs."""
    from qnext.bench.presets import PRESETS

    small, real = PRESETS["small"].overrides, PRESETS["small-248k"].overrides
    assert {k: v for k, v in real.items() if k not in ("tokenizer", "tie_word_embeddings")} == \
        {k: v for k, v in small.items() if k != "vocab_size"}
    assert real["tokenizer"] == "qwen3.5" and small["vocab_size"] == 8192
    assert PRESETS["small-248k"].family == PRESETS["small"].family


def test_bench_sampler_reports_each_mode(tmp_path):
    """scripts/bench_sampler.py on the tiny preset: a decode step per row count, and per batch, logits kind and
    mode the sampler's time; top-k / top-p modes time the window and the sort, and the verify its acceptance."""
    out = tmp_path / "sampler.json"
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_sampler.py"), "--model", "tiny",
                           "--batches", "2", "--k", "1", "--repeats", "1", "--modes", "greedy,top_p",
                           "--logits", "model,flat",
                           "--out-dir", str(tmp_path / "bench_out"), "--json-out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["vocab"] == 512 and set(report["decode_step_s"]) == {"2", "4"}
    assert [(r["logits"], r["mode"]) for r in report["results"]] == [
        ("model", "greedy"), ("model", "top_p"), ("flat", "greedy"), ("flat", "top_p")]
    for r in report["results"]:
        assert r["sample_s"] > 0 and r["verify_s"] > 0
        assert ("sort_s" in r) == ("window_s" in r) == (r["mode"] == "top_p")
    assert "share" in proc.stdout
