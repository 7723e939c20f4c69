"""scripts/train_and_generate.py, run as a user runs it: a few REINFORCE steps on the Flax model, copied into the
engine with update_weights, raise the toy reward of the engine's samples."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from qnext.testing.tiny_checkpoint import demo_checkpoint_dir

ROOT = Path(__file__).resolve().parents[2]


def test_training_example_raises_the_reward(tmp_path):
    model = demo_checkpoint_dir(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_and_generate.py"), "--model", str(model)],
                          capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"reward after training: ([\d.]+) \(before ([\d.]+)", proc.stdout)
    assert found, proc.stdout
    after, before = map(float, found.groups())
    assert after > before + 0.25, proc.stdout
