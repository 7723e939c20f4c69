"""What `qnext serve` does before it listens: JAX's persistent compilation cache, and warm-up with progress.

The cache is on by default, under the user's cache directory (`$XDG_CACHE_HOME/qnext/jax`, else
`~/.cache/qnext/jax`); `--compilation-cache-dir DIR` or QNEXT_COMPILATION_CACHE_DIR moves it, and `none` turns it
off. With it, a second start of the same model and options loads every step shape from disk instead of
compiling it; and since tracing and lowering all of them again still took most of a start (24 s of a second start
on the demo, this 2-core machine, load ~3), a start whose shapes an earlier start already compiled into the cache
(a marker file per model shape, engine options and JAX version says so) skips the warm-up: each shape is read
back from the cache on its first use, a fraction of a second, and the server listens at once."""
from __future__ import annotations

import hashlib
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


def warm_up_marker(cache_dir: str, engine) -> Path:
    """The file that says an earlier start compiled every step shape of this model shape and these engine options
    with this JAX into cache_dir (weights do not change a compiled program)."""
    import jax

    key = repr((engine.model_config, engine.config, engine.num_step_shapes, jax.__version__, jax.devices()[0].platform))
    return Path(cache_dir) / f"qnext-warm-{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def warm_up_unless_cached(engine, cache_dir: str | None, log=logger.info) -> bool:
    """Warms the engine up, unless the compilation cache already holds its step shapes (see the module docstring)
    -> whether it warmed up. After a warm-up with the cache on, leaves the marker."""
    marker = warm_up_marker(cache_dir, engine) if cache_dir is not None else None
    if marker is not None and marker.exists():
        log(f"the compilation cache holds this model's {engine.num_step_shapes} step shapes from an earlier start: "
            "each loads on its first use (--no-warm-up-cache-check compiles them all now)")
        return False
    warm_up_with_progress(engine, log)
    if marker is not None:
        marker.touch()
    return True
