"""`qnext serve`'s persistent compilation cache: where it goes, how it is turned off, and that a program compiled
once is read back from disk after the in-memory caches are gone (as on a second start). Runs in a subprocess: the
cache directory is process-wide JAX state."""
from __future__ import annotations

import subprocess
import sys

from qnext.server.startup import default_compilation_cache_dir, enable_compilation_cache

SECOND_START = """
import sys
import jax, jax.numpy as jnp
from qnext.server.startup import enable_compilation_cache
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


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("QNEXT_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compilation_cache_dir() == str(tmp_path / "qnext" / "jax")
    monkeypatch.setenv("QNEXT_COMPILATION_CACHE_DIR", "/somewhere/else")
    assert default_compilation_cache_dir() == "/somewhere/else"
    for off in ("none", "", "off", None):
        assert enable_compilation_cache(off) is None


def test_a_compiled_program_is_read_back_from_disk(tmp_path):
    out = subprocess.run([sys.executable, "-c", SECOND_START, str(tmp_path / "jax")], capture_output=True, text=True,
                         timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                                           "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) >= 1
    assert any((tmp_path / "jax").iterdir())
