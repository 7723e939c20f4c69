"""scripts/gpu_check.py: with no GPU it says so and exits non-zero; its kernel cases and checks work on CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_no_gpu_exits_non_zero_with_a_clear_message(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no NVIDIA GPU visible to JAX" in proc.stderr
    assert "jax[cuda12]" in proc.stderr
    assert not out.exists()


def test_model_shapes_are_the_three_layer_sizes():
    assert gpu_check.MODELS == {"qwen3.5-27b": ((24, 4), (16, 48)), "qwen3-next-80b": ((16, 2), (16, 32)),
                                "qwen3.5-397b": ((32, 2), (16, 64))}


def test_kernel_cases_are_valid_calls_and_a_row_compares(monkeypatch):
    """Every case of the kernel stage is a valid call of its op at the real layer shapes (traced, not run), and
    one row runs end to end at small sizes (reference vs reference on CPU: exact, lowered to no Pallas call)."""
    import functools

    import jax

    for model in gpu_check.MODELS:
        for name, op, make_args, kwargs in gpu_check.kernel_cases(model):
            jax.eval_shape(lambda: functools.partial(op, implementation="reference", **kwargs)(*make_args()))
    monkeypatch.setattr(gpu_check, "DECODE_ROWS", 2)
    monkeypatch.setattr(gpu_check, "MODELS", {"qwen3-next-80b": ((4, 2), (2, 4))})
    name, op, make_args, kwargs = [c for c in gpu_check.kernel_cases("qwen3-next-80b") if "update" in c[0]][0]
    row = gpu_check.check_case(name, op, make_args(), kwargs, "reference", repeats=1)
    assert row["ok"] and row["lowered_to"] == "none"
    assert [o["max_abs_err"] for o in row["outputs"]] == [0.0, 0.0]


def test_chunked_delta_rule_case_keeps_row_0_the_zero_state_and_the_triton_kernel_matches(monkeypatch):
    """The state pools of the delta-rule cases have row 0 the zero state (the ops' contract). With a random row 0,
    the reference and the Mosaic kernel read it as a fresh sequence's initial state and the Triton kernel read zeros:
    ~0.03 output errors on the GPU, reproduced here with the Triton kernel in the interpreter. Sequence 1 starts
    from the state in its own row, so a non-zero initial state is checked too."""
    import numpy as np

    monkeypatch.setattr(gpu_check, "MODELS", {"qwen3-next-80b": ((4, 2), (1, 2))})
    monkeypatch.setattr(gpu_check, "GDR_LEN", 256)
    name, op, make_args, _ = [c for c in gpu_check.kernel_cases("qwen3-next-80b") if c[0].startswith("chunk")][0]
    args = make_args()
    state, read, write = args[6], args[7], args[8]
    assert not np.any(np.asarray(state[0])) and np.all(np.abs(np.asarray(state[1:])).sum(axis=(1, 2, 3)) > 0)
    assert set(np.asarray(read).tolist()) == {-1, 2} and set(np.asarray(write).tolist()) == {1, 2}
    row = gpu_check.check_case(name, op, args, dict(interpret=True), "triton", repeats=1)
    assert row["ok"], row["outputs"]
    assert row["outputs"][0]["max_abs_err"] < 1e-4
    # a random row 0 (the old inputs' had the scale of the other rows; 3x here, for a margin) fails the same check
    bad = (*args[:6], state.at[0].set(3 * state[1]), *args[7:])
    reference = gpu_check.time_reference(op, bad, dict(interpret=True), 1)
    assert not gpu_check.check_case(name, op, bad, dict(interpret=True), "triton", 1, reference)["ok"]


def test_kernel_and_model_filters(monkeypatch):
    import pytest

    assert gpu_check._choice("chunk_gated_delta_rule", gpu_check.KERNELS, "--kernels") == ["chunk_gated_delta_rule"]
    with pytest.raises(SystemExit, match="--models must be a comma list of qwen3.5-27b"):
        gpu_check._choice("qwen3-80b", tuple(gpu_check.MODELS), "--models")
    seen = []
    monkeypatch.setattr(gpu_check, "check_case", lambda name, *a, **k: seen.append(name) or dict(
        kernel=name, backend="reference", ok=True, outputs=[dict(max_abs_err=0.0)], lowered_to="none",
        kernel_ms=1.0, xla_ms=1.0, speedup=1.0))
    monkeypatch.setattr(gpu_check, "time_reference", lambda *a: None)
    rows = gpu_check.run_kernels(["reference"], 1, float("inf"), ["qwen3.5-27b"], ["recurrent_gated_delta_rule"])
    assert seen == ["recurrent_gated_delta_rule N=32"] and [r["model"] for r in rows] == ["qwen3.5-27b"]


def test_bench_writes_its_json_and_log_next_to_the_report_and_the_rest_elsewhere(tmp_path, monkeypatch):
    import json
    import subprocess as sp

    def fake_run(cmd, **kwargs):
        assert cmd[cmd.index("--out-dir") + 1] == str(tmp_path / "work")
        assert cmd[cmd.index("--batches") + 1] == "small:1,16"
        Path(cmd[cmd.index("--json-out") + 1]).write_text(json.dumps({"rows": []}))
        return sp.CompletedProcess(cmd, 0, "bench says hi", "W ... Out of memory while trying to allocate 1GiB\n" * 3)

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    report = tmp_path / "out" / "gpu_check.json"
    report.parent.mkdir()
    result = gpu_check.run_bench(report, tmp_path / "work", 300)
    assert result["report"] == {"rows": []} and result["returncode"] == 0
    assert sorted(p.name for p in report.parent.iterdir()) == ["gpu_check_bench.json", "gpu_check_bench.log"]
    assert "bench says hi" in (report.parent / "gpu_check_bench.log").read_text()
    assert len(result["oom_lines"]) == 3


def test_fp8_rows_are_valid_calls_and_the_matmul_rows_run(monkeypatch):
    """The FP8 rows (scripts/gpu_check_fp8.py): the fp8-page attention cases are valid calls at the real shapes
    (traced), with e4m3 pages; the fp8 matmul rows run end to end at small sizes on CPU, both formulations within
    the bound of the GEMM of the dequantised weights, with XLA's temporary bytes reported."""
    import functools

    import jax

    import gpu_check_fp8

    for model in gpu_check.MODELS:
        cases = gpu_check_fp8.fp8_attention_cases(model, gpu_check.MODELS, (gpu_check.DECODE_ROWS, 4096),
                                                  (8, 2048, gpu_check.C), gpu_check.BLOCK_SIZE, gpu_check.D)
        for name, op, make_args, kwargs in cases:
            args = jax.eval_shape(make_args)
            assert args[1].dtype.name == "float8_e4m3fn", name
            jax.eval_shape(functools.partial(op, implementation="reference", **kwargs), *args)
    rows = gpu_check_fp8.fp8_matmul_rows(["qwen3.5-27b"], 1, float("inf"), rows=(4,),
                                         dense={"qwen3.5-27b": (256, 384)})
    assert [r["kernel"].split()[1] for r in rows] == ["dequantize", "scaled_dot"]
    assert all(r["ok"] and r["temp_bytes"] >= 0 for r in rows), rows
    assert rows[0]["outputs"][0]["max_abs_err"] == 0.0     # the dequantize path is the reference's arithmetic
