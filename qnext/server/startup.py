"""What `qnext serve` does before it listens: JAX's persistent compilation cache, and warm-up with progress.

The cache is on by default, under the user's cache directory (`$XDG_CACHE_HOME/qnext/jax`, else
`~/.cache/qnext/jax`); `--compilation-cache-dir DIR` or QNEXT_COMPILATION_CACHE_DIR moves it, and `none` turns it
off. With it, a second start of the same model and options loads every step shape from disk instead of
compiling it."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("qnext.server")

CACHE_DIR_ENV = "QNEXT_COMPILATION_CACHE_DIR"
DISABLED = ("", "none", "off")


def default_compilation_cache_dir() -> str:
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured is not None:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "qnext" / "jax")


def enable_compilation_cache(cache_dir: str | None) -> str | None:
    """Points JAX's persistent cache at cache_dir (before anything compiles) -> the directory, or None if off.
    Every compilation is cached, however quick: a start compiles many small step shapes."""
    if cache_dir is None or cache_dir.strip().lower() in DISABLED:
        return None
    import jax

    path = Path(cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(path)


def warm_up_with_progress(engine, log=logger.info, every_seconds: float = 5.0) -> None:
    """engine.warm_up(), logging how many step shapes are done at most every `every_seconds`, and the total."""
    total, done, start = engine.num_step_shapes, 0, time.perf_counter()
    last = start
    log(f"compiling {total} step shapes (loaded from the compilation cache when it has them)")

    def on_bucket():
        nonlocal done, last
        done += 1
        now = time.perf_counter()
        if now - last >= every_seconds and done < total:
            log(f"compiled {done}/{total} step shapes in {now - start:.0f} s")
            last = now

    engine.warm_up(on_bucket)
    log(f"compiled {total} step shapes in {time.perf_counter() - start:.1f} s")
