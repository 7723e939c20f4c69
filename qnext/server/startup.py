"""What `qnext serve` does before it listens: warm-up with progress, skipped when the compilation cache holds every
step shape from an earlier start (qnext/engine/compilation_cache.py: the cache is the engine's, on by default)."""
from __future__ import annotations

import logging
import time

logger = logging.getLogger("qnext.server")


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
