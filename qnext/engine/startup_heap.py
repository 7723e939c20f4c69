"""The start-up heap kept out of the cyclic GC's walks, for long-running front ends (docs/engine.md)."""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Makes every object alive now permanent for Python's cyclic GC, as vLLM does after start-up: otherwise each
    oldest-generation collection walks the whole start-up heap (JAX, the tokenizer, the engine), which cost ~2 ms a
    step at 64 rows of the tiny model (docs/engine.md). Optional, for long-running front ends and benchmarks; a
    library constructor does not call it."""
    gc.collect()
    gc.freeze()
