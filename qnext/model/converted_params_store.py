"""Converted params stored with orbax, so a second load of the same checkpoint skips conversion.

Layout: `<cache_dir>/<key>/` is one orbax checkpoint. The key hashes the checkpoint's resolved path, the name,
size and mtime of each of its config and weight files, the dtype and the converter version, so editing or
replacing the checkpoint gives a new key.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from qnext.config import ModelConfig
from qnext.model.weights import as_dtype, map_specs, param_specs
from qnext.model.host_devices import engine_devices

log = logging.getLogger(__name__)

# Bump when the converted layout changes so old caches are ignored.
FORMAT_VERSION = 2   # 2: dense weights [out, in]
_KEYED_SUFFIXES = (".safetensors", ".json")


def cache_key(checkpoint_dir: str | Path, dtype: Any) -> str:
    root = Path(checkpoint_dir).resolve()
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{root}|{as_dtype(dtype).name}".encode())
    for f in sorted(root.iterdir()):
        if f.suffix in _KEYED_SUFFIXES and f.is_file():
            st = f.stat()
            h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def restore_converted(cache_dir: str | Path, key: str, cfg: ModelConfig, dtype: Any) -> dict[str, Any] | None:
    """The cached params as jax arrays on the default device, or None when there is no usable entry."""
    import jax
    import orbax.checkpoint as ocp

    path = Path(cache_dir).resolve() / key
    if not (path / "commit_success.txt").exists() and not (path / "_CHECKPOINT_METADATA").exists():
        return None
    sharding = jax.sharding.SingleDeviceSharding(engine_devices()[0])
    abstract = map_specs(
        lambda _, s: jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=sharding), param_specs(cfg, dtype)
    )
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(path, abstract)
    except Exception as e:  # a partial or foreign entry: convert again
        log.warning("ignoring unreadable converted checkpoint %s (%s); converting again", path, e)
        return None
    log.info("restored converted params from %s", path)
    return params


def save_converted(cache_dir: str | Path, key: str, params: dict[str, Any]) -> Path:
    import orbax.checkpoint as ocp

    path = Path(cache_dir).resolve() / key
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params)
        ckptr.wait_until_finished()
    log.info("saved converted params to %s", path)
    return path
