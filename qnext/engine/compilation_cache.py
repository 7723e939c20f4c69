"""JAX's persistent compilation cache, on by default for every engine (the LLM, `qnext serve`, the scripts).

A second process that runs the same model shape with the same engine options reads each step's executable from
disk instead of compiling it. The engine option `compilation_cache_dir` picks the directory: None (the default)
means $QNEXT_COMPILATION_CACHE_DIR, else a directory already set with `jax.config.update(
"jax_compilation_cache_dir", ...)`, else `$XDG_CACHE_HOME/qnext/jax` (`~/.cache/qnext/jax`); "none" leaves JAX's
setting alone (off unless set in JAX). The cache is process-wide JAX state: an engine that names another directory
moves it for the whole process.

Over several processes (`--nnodes`), JAX writes cache entries from process 0 only (jax/_src/compiler.py
`_cache_write`), so a rank > 0 on a host of its own compiled every step shape at every start. Each rank > 0 therefore
keeps its own entries in `<dir>/rank-<r>` (no two processes write one file, even when the ranks share a host or a
network file system) and writes them itself (`_write_on_every_rank`).

Tracing and lowering each step shape again still costs a cached start most of its warm-up, so a warm-up that
completes leaves a marker file (per model shape, engine options, step-shape count, JAX version and platform) in the
cache directory, and `warm_up_unless_cached` skips the warm-up of a later start that finds it: each step shape
is then read back from the cache on its first use, a fraction of a second."""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

logger = logging.getLogger("qnext.engine")

CACHE_DIR_ENV = "QNEXT_COMPILATION_CACHE_DIR"
OFF = ("", "none", "off")


def default_compilation_cache_dir() -> str:
    """$QNEXT_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/qnext/jax, else ~/.cache/qnext/jax."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured is not None:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "qnext" / "jax")


def resolve_compilation_cache_dir(option: str | os.PathLike | None) -> str | None:
    """The engine option -> the directory to use, or None for off (see the module docstring for the order)."""
    if option is None:
        if CACHE_DIR_ENV not in os.environ:
            import jax

            option = jax.config.jax_compilation_cache_dir or default_compilation_cache_dir()
        else:
            option = os.environ[CACHE_DIR_ENV]
    option = os.fspath(option)
    return None if option.strip().lower() in OFF else str(Path(option).expanduser())


def enable_compilation_cache(option: str | os.PathLike | None) -> str | None:
    """Points JAX's persistent cache at the option's directory (call it before anything compiles) -> the directory,
    or None when off. Every compilation is cached, however quick: a start compiles many small programs."""
    path = resolve_compilation_cache_dir(option)
    if path is None:
        return None
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    rank = jax.process_index() if jax.process_count() > 1 else 0
    if rank > 0:
        path = path if Path(path).name == f"rank-{rank}" else str(Path(path) / f"rank-{rank}")
        _write_on_every_rank()
    Path(path).mkdir(parents=True, exist_ok=True)
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if previous is not None and previous != path:      # JAX opens its cache once: reopen it on the new directory
        logger.warning("JAX's compilation cache moves from %s to %s for this process", previous, path)
        compilation_cache.reset_cache()
    return path


def _write_on_every_rank() -> None:
    """Lets this process (a rank > 0) write its compiled programs into its cache directory as process 0 does. JAX
    has no option for it: this wraps its private `_cache_write` once; with another JAX that lacks it, ranks > 0 read
    the cache but do not fill it (logged)."""
    from jax._src import compilation_cache as jax_cache, compiler, config, distributed

    original = getattr(compiler, "_cache_write", None)
    if original is None or getattr(original, "qnext_every_rank", False):
        if original is None:
            logger.warning("this JAX has no compiler._cache_write: ranks > 0 will not fill their compilation cache")
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id == 0 or host_callbacks:
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            jax_cache.put_executable_and_time(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:           # as JAX does: a cache that cannot be written costs a compile, not the run
            logger.warning("could not write %s to the compilation cache: %s", module_name, e)
        return None

    cache_write.qnext_every_rank = True
    compiler._cache_write = cache_write


def warm_up_marker(cache_dir: str, engine) -> Path:
    """The file that says an earlier warm-up compiled every step shape of this model shape and these engine options
    with this JAX into cache_dir (weights do not change a compiled program)."""
    import jax

    key = repr((engine.model_config, engine.config, engine.num_step_shapes, jax.__version__,
                jax.devices()[0].platform))
    return Path(cache_dir) / f"qnext-warm-{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def warm_up_unless_cached(engine, cache_dir: str | None, warm_up: Callable[[], object],
                          log: Callable[[str], object] = logger.info) -> bool:
    """Runs warm_up() unless the compilation cache in cache_dir already holds the engine's step shapes (its marker
    is there) -> whether it warmed up. After a warm-up with the cache on, leaves the marker."""
    marker = warm_up_marker(cache_dir, engine) if cache_dir is not None else None
    if marker is not None and marker.exists():
        log(f"the compilation cache holds this model's {engine.num_step_shapes} step shapes from an earlier start: "
            "each loads on its first use")
        return False
    warm_up()
    if marker is not None:
        marker.touch()
    return True
