"""The README's library snippets run as written (only the checkpoint path replaced by the tiny demo's), each in a
fresh interpreter: `import qnext` alone must make `qnext.flax` usable."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qnext.testing.tiny_checkpoint import demo_checkpoint_dir

ROOT = Path(__file__).resolve().parents[2]


def _snippets() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return {"library use": next(b for b in blocks if "qnext.load_model" in b),
            "training loop": next(b for b in blocks if "qnext.flax.from_pretrained" in b)}


@pytest.mark.parametrize("name", ["library use", "training loop"])
def test_readme_snippet_runs_as_written(name, tmp_path):
    code = _snippets()[name].replace("/path/to/checkpoint", str(demo_checkpoint_dir()))
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
