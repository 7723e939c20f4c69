"""JAX's persistent compilation cache, on by default for every engine: where it goes, how it is turned off, that a
program compiled once is read back from disk in a fresh process, and that a second run of scripts/generate.py (an
LLM with the default options) compiles nothing and skips its warm-up. The processes that use a cache run as
subprocesses: the cache directory is process-wide JAX state (conftest.py turns the default off for the tests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qnext.engine.compilation_cache import (CACHE_DIR_ENV, default_compilation_cache_dir, enable_compilation_cache,
                                            resolve_compilation_cache_dir, warm_up_unless_cached)
from qnext.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]

SECOND_START = """
import sys
import jax, jax.numpy as jnp
from qnext.engine.compilation_cache import enable_compilation_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
assert enable_compilation_cache(sys.argv[1]) == sys.argv[1]
f = lambda x: jnp.tanh(x) * 3 + 1            # compiles in well under a second: cached all the same
jax.jit(f)(jnp.ones(7)).block_until_ready()
jax.clear_caches()
events.clear()
jax.jit(f)(jnp.ones(7)).block_until_ready()
print(sum(name == "/jax/compilation_cache/cache_hits" for name in events))
"""

# scripts/generate.py as a user runs it, counting the persistent cache's hits and misses (a miss: XLA compiles)
GENERATE = """
import json, runpy, sys
import jax
counts = {"hits": 0, "misses": 0}
names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
jax.monitoring.register_event_listener(lambda name, **kw: names.get(name) and counts.__setitem__(
    names[name], counts[names[name]] + 1))
sys.argv = ["generate.py", *sys.argv[1:]]
try:
    runpy.run_path(%r, run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("COUNTS " + json.dumps(counts))
""" % str(ROOT / "scripts" / "generate.py")


def test_the_directory_follows_the_option_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compilation_cache_dir() == str(tmp_path / "qnext" / "jax")
    assert resolve_compilation_cache_dir(None) == str(tmp_path / "qnext" / "jax")
    monkeypatch.setenv(CACHE_DIR_ENV, "/somewhere/else")
    assert resolve_compilation_cache_dir(None) == "/somewhere/else"
    assert resolve_compilation_cache_dir(tmp_path / "mine") == str(tmp_path / "mine")     # the option wins
    for off in ("none", "", "off", "None"):
        assert resolve_compilation_cache_dir(off) is None and enable_compilation_cache(off) is None
        monkeypatch.setenv(CACHE_DIR_ENV, off)
        assert resolve_compilation_cache_dir(None) is None


def test_a_bad_option_says_what_is_wrong():
    with pytest.raises(ValueError, match="compilation_cache_dir must be a path, got 3"):
        EngineConfig(compilation_cache_dir=3)


def test_a_compiled_program_is_read_back_from_disk(tmp_path):
    out = subprocess.run([sys.executable, "-c", SECOND_START, str(tmp_path / "jax")], capture_output=True, text=True,
                         timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                                           "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) >= 1
    assert any((tmp_path / "jax").iterdir())


def test_a_second_run_of_generate_reads_every_program_from_the_default_cache(tiny_checkpoint, tmp_path):
    """Nothing names a cache: the default, under $XDG_CACHE_HOME, fills on the first run; the second run reads
    every program back (no XLA compilation), skips the warm-up and prints the same text."""
    model = tiny_checkpoint("qwen3_5")
    env = {k: v for k, v in os.environ.items() if k != CACHE_DIR_ENV}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path))
    args = ["--model", str(model), "--prompt", "Hello there", "--raw", "--max-tokens", "3",
            "--max-num-batched-tokens", "16", "--max-model-len", "64"]

    def run():
        proc = subprocess.run([sys.executable, "-c", GENERATE, *args], capture_output=True, text=True, env=env,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        counts = json.loads(next(line for line in lines if line.startswith("COUNTS "))[len("COUNTS "):])
        return counts, [line for line in lines if "tokens/s" not in line and not line.startswith("COUNTS ")]

    first, first_text = run()
    cache = tmp_path / "qnext" / "jax"
    assert first["misses"] >= 2 and first["hits"] == 0, first         # at least the two step shapes compiled
    assert len([p for p in cache.iterdir() if p.name.startswith("qnext-warm-")]) == 1
    second, second_text = run()
    assert second["misses"] == 0 and second["hits"] >= 2, second
    assert second_text == first_text


class _FakeEngine:
    def __init__(self, model_config, config, num_step_shapes=3):
        self.model_config, self.config, self.num_step_shapes, self.warm_ups = model_config, config, num_step_shapes, 0

    def warm_up(self):
        self.warm_ups += 1


def test_a_start_whose_shapes_are_cached_skips_the_warm_up(tmp_path):
    def start(engine, cache_dir):
        return warm_up_unless_cached(engine, cache_dir, engine.warm_up, log=lambda m: None)

    first = _FakeEngine("model A", "options 1")
    assert start(first, str(tmp_path)) and first.warm_ups == 1
    again = _FakeEngine("model A", "options 1")                # the second start: same shapes and options
    assert not start(again, str(tmp_path)) and again.warm_ups == 0
    for other in (_FakeEngine("model B", "options 1"), _FakeEngine("model A", "options 2"),
                  _FakeEngine("model A", "options 1", num_step_shapes=4)):
        assert start(other, str(tmp_path)) and other.warm_ups == 1
    no_cache = _FakeEngine("model A", "options 1")             # the cache off (or the check off): always warms up
    assert start(no_cache, None) and no_cache.warm_ups == 1


def test_the_serve_flag_is_the_engine_option():
    from qnext.server.cli import build_parser

    parser, names = build_parser()
    assert "compilation_cache_dir" in names
    assert parser.parse_args(["serve", "--compilation-cache-dir", "none"]).compilation_cache_dir == "none"
    assert parser.parse_args(["serve"]).compilation_cache_dir is None          # the engine's default
