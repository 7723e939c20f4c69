"""scripts/generate.py on the demo checkpoint (which has the tiny vision tower): `--image` puts a picture before the
prompt's text (its 16 pads are counted), and a path that is not a picture fails by name."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.vision_checkpoint import picture

ROOT = Path(__file__).resolve().parents[2]


def run_generate(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--max-tokens", "2", "--no-warm-up",
                           *args], capture_output=True, text=True, env=env, timeout=600)


def test_generate_reads_a_picture_on_the_demo(tmp_path):
    picture(4).save(tmp_path / "picture.png")
    text, image = run_generate("--prompt", "What is this?"), run_generate("--image", str(tmp_path / "picture.png"),
                                                                         "--prompt", "What is this?")
    assert text.returncode == 0 and image.returncode == 0, (text.stderr + image.stderr)[-3000:]
    prompt_tokens = [int(re.search(r"\[stats\].* prompt tokens (\d+),", p.stdout).group(1)) for p in (text, image)]
    assert prompt_tokens[1] == prompt_tokens[0] + 18       # <|vision_start|>, 16 pads, <|vision_end|>
    (tmp_path / "notes.txt").write_text("not a picture")
    bad = run_generate("--image", str(tmp_path / "notes.txt"), "--prompt", "What is this?")
    assert bad.returncode != 0 and "--image" in bad.stderr and "notes.txt" in bad.stderr
