"""The fingerprint a persisted prefix cache is bound to (plain Python, no jax): what the cached KV and states depend
on. A cache file whose fingerprint differs in any part is never loaded (cache/cache_file.py)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

import numpy as np

# Bump when the meaning of the cache's contents or of the file's index changes (buffer layouts, hashing).
CACHE_LAYOUT_VERSION = 1


def files_digest(paths: Iterable[Path]) -> str:
    """blake2b of the files' names and bytes (e.g. a checkpoint's safetensors files), read in 8 MiB pieces."""
    h = hashlib.blake2b(digest_size=16)
    for path in paths:
        h.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            while piece := f.read(8 << 20):
                h.update(piece)
    return h.hexdigest()


def files_digest_memoized(paths: Iterable[Path], memo: Path) -> str:
    """files_digest, remembered in the JSON file `memo` under the files' names, sizes and modification times: a
    checkpoint read once is not read again at the next start (it is re-read when any of those change, as a copy or
    a rewrite does). A missing or unreadable memo is recomputed; a memo that cannot be written is skipped."""
    paths = [Path(p) for p in paths]
    key = [[p.name, st.st_size, st.st_mtime_ns] for p in paths for st in [p.stat()]]
    try:
        saved = json.loads(Path(memo).read_text())
        if saved.get("files") == key and isinstance(saved.get("digest"), str):
            return saved["digest"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = files_digest(paths)
    try:
        Path(memo).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{memo}.tmp")
        tmp.write_text(json.dumps({"files": key, "digest": digest}))
        tmp.replace(memo)
    except OSError:
        pass
    return digest


def arrays_digest(arrays: Iterable) -> str:
    """blake2b of arrays' dtypes, shapes and bytes (e.g. in-memory weights, in a fixed order)."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype.name}{a.shape}".encode())
        h.update(a.view(np.uint8).reshape(-1))
    return h.hexdigest()


def cache_fingerprint(model_config: dict, weights_digest: str, dtype: str, block_size: int,
                      kv_dtype: str | None = None, snapshot_dtype: str = "float32") -> dict:
    """The parts a persisted cache must agree on, each comparable on its own (the warning names the first that
    differs). kv_dtype: the KV pages' storage dtype (None: `dtype`); snapshot_dtype: the stored recurrent state's."""
    config = json.dumps(model_config, sort_keys=True, default=str).encode()
    return {"layout_version": CACHE_LAYOUT_VERSION, "block_size": int(block_size), "dtype": str(dtype),
            "kv_dtype": str(kv_dtype or dtype), "snapshot_dtype": str(snapshot_dtype),
            "model_config": hashlib.blake2b(config, digest_size=16).hexdigest(), "weights": weights_digest}
