"""scripts/gpu_check.py: with no GPU it says so and exits non-zero; its kernel cases and checks work on CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


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


def test_kernel_stage_runs_end_to_end_at_small_sizes(monkeypatch):
    """The kernel stage's cases at small sizes, reference vs reference on CPU: every case builds, runs and
    matches (a GPU run differs only in the backend names and the sizes)."""
    for name, value in dict(DECODE_ROWS=2, DECODE_KV_LEN=100, PREFILL_SEQS=1, PREFILL_KV_LEN=100, GDR_SEQS=1,
                            GDR_LEN=100, D=64, DK=64, DV=64).items():
        monkeypatch.setattr(gpu_check, name, value)
    monkeypatch.setattr(gpu_check, "MODELS", {"qwen3-next-80b": ((4, 2), (2, 4))})
    rows = gpu_check.run_kernels(["reference"], repeats=1, deadline=float("inf"))
    assert len(rows) == 6
    assert all(r["ok"] for r in rows), [r.get("error") for r in rows]
    assert all(r["lowered_to"] == "none" and r["outputs"][0]["max_abs_err"] == 0.0 for r in rows)
