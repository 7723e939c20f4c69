from __future__ import annotations

import os

import pytest

# Hermetic: no engine, server or script the tests start writes JAX's compilation cache into ~/.cache (the engines'
# default); tests of the cache name a temporary directory.
os.environ["QNEXT_COMPILATION_CACHE_DIR"] = "none"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """make(family, **write_tiny_checkpoint kwargs) -> Path; each distinct checkpoint is written once per session.
    Treat it as read-only; tests that edit files write their own with write_tiny_checkpoint(tmp_path, ...)."""
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    made = {}

    def make(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = write_tiny_checkpoint(tmp_path_factory.mktemp(family), family, **kwargs)
        return made[key]

    return make


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """After each module, drop JAX's caches of compiled steps. Every XLA:CPU executable holds memory mappings of
    its own; kept for the whole run, one pytest process of this suite passed Linux's default vm.max_map_count
    (65,530) and XLA crashed (SIGSEGV) compiling the next step. A module's steps are not reused by the next one."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
