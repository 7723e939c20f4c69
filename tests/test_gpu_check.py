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
