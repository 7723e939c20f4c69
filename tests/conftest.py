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
