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


class _FakeEngine:
    def __init__(self, model_config, config, num_step_shapes=3):
        self.model_config, self.config, self.num_step_shapes, self.warm_ups = model_config, config, num_step_shapes, 0

    def warm_up(self, on_bucket=None):
        self.warm_ups += 1
        for _ in range(self.num_step_shapes):
            on_bucket()


def test_a_start_whose_shapes_are_cached_skips_the_warm_up(tmp_path):
    from qnext.server.startup import warm_up_unless_cached

    first = _FakeEngine("model A", "options 1")
    assert warm_up_unless_cached(first, str(tmp_path), log=lambda m: None) and first.warm_ups == 1
    again = _FakeEngine("model A", "options 1")                # the second start: same shapes and options
    assert not warm_up_unless_cached(again, str(tmp_path), log=lambda m: None) and again.warm_ups == 0
    for other in (_FakeEngine("model B", "options 1"), _FakeEngine("model A", "options 2"),
                  _FakeEngine("model A", "options 1", num_step_shapes=4)):
        assert warm_up_unless_cached(other, str(tmp_path), log=lambda m: None) and other.warm_ups == 1
    no_cache = _FakeEngine("model A", "options 1")             # the cache off (or the check off): always warms up
    assert warm_up_unless_cached(no_cache, None, log=lambda m: None) and no_cache.warm_ups == 1
