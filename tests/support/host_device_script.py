"""Runs a test's script in a fresh Python started with N XLA host devices (the flag must be set before JAX starts,
and the test process has one device) and returns the JSON object the script prints on its last line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_on_host_devices(script: str, num_devices: int, *args: str, timeout: float = 900) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
