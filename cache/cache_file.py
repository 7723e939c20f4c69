"""The prefix cache's file (plain Python and numpy, no jax): written atomically, read back only when it is whole and
was written for the same model and setup.

Layout of `<prefix_cache_dir>/prefix_cache.qnext`:
    MAGIC (8 bytes) | header length (8 bytes, little endian) | header (JSON, utf-8) | sha256(header) (32 bytes)
    | payload: the arrays' bytes, one after the other | sha256(payload) (32 bytes)
The header holds the fingerprint (cache/fingerprint.py), the format version and each array's name, dtype, shape,
offset and size; what the arrays mean is the caller's (cache/persisted_cache.py). The header is checked before the
fingerprint, so a damaged header reads as damaged, not as another model's; the payload's checksum is checked before
any of it is used. Writing goes to a temporary file in the same directory, fsynced, then os.replace'd over the old
file (and the directory fsynced): a crash leaves the old file or the new one, never a mix.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import mmap
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

logger = logging.getLogger("qnext.cache")

FILE_NAME = "prefix_cache.qnext"
TMP_PREFIX, TMP_SUFFIX = ".prefix_cache.", ".tmp"      # a write in progress (renamed over FILE_NAME when whole)
MAGIC = b"QNXTPC\r\n"
FORMAT_VERSION = 1
_DIGEST = 32


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """An array to write: its name, dtype name, shape, and a function that makes it when its turn comes (so that
    at most one array of a large cache is in memory at a time)."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _dtype(self.dtype).itemsize


def write_cache_file(directory: str | os.PathLike, header: dict, arrays: list[ArraySpec]) -> Path:
    """Writes the file atomically; returns its path. `header` must be JSON-serialisable."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries, offset = [], 0
    for a in arrays:
        entries.append({"name": a.name, "dtype": a.dtype, "shape": list(a.shape), "offset": offset,
                        "nbytes": a.nbytes})
        offset += a.nbytes
    head = json.dumps({**header, "format": FORMAT_VERSION, "arrays": entries}).encode()
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=TMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + len(head).to_bytes(8, "little") + head + hashlib.sha256(head).digest())
            payload = hashlib.sha256()
            for a, entry in zip(arrays, entries):
                data = np.ascontiguousarray(a.make(), dtype=_dtype(a.dtype))
                if data.shape != a.shape:
                    raise ValueError(f"array {a.name} has shape {data.shape}; its spec says {a.shape}")
                view = memoryview(data.reshape(-1).view(np.uint8))
                payload.update(view)
                f.write(view)
            f.write(payload.digest())
            f.flush()
            os.fsync(f.fileno())
        path = directory / FILE_NAME
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    return path


class CacheFile:
    """A verified cache file, mapped read-only: `header` and `array(name)` (valid until `close`)."""

    def __init__(self, path: Path, header: dict, mapped: mmap.mmap, payload_start: int):
        self.path, self.header = path, header
        self._mapped, self._start = mapped, payload_start
        self._arrays = {a["name"]: a for a in header["arrays"]}

    def array(self, name: str) -> np.ndarray:
        a = self._arrays[name]
        count = int(np.prod(a["shape"], dtype=np.int64))
        return np.frombuffer(self._mapped, _dtype(a["dtype"]), count, self._start + a["offset"]).reshape(a["shape"])

    def close(self) -> None:
        try:
            self._mapped.close()
        except BufferError:      # an array view still alive (e.g. in a traceback): the mapping goes with it
            pass


def read_cache_file(directory: str | os.PathLike, fingerprint: dict) -> CacheFile | None:
    """The cache file in `directory` if it is whole and its fingerprint equals `fingerprint`; otherwise None, with
    one warning saying why (none when there is no file yet). Writes that a crash interrupted (their temporary files)
    are removed first: one engine owns a cache directory, so none of them can still be in progress."""
    remove_interrupted_writes(directory)
    path = Path(directory) / FILE_NAME
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:                 # an empty file cannot be mapped
            return _ignore(path, "it is empty")
    reason, header, start = _check(mapped, fingerprint)
    if reason is not None:
        mapped.close()
        return _ignore(path, reason)
    return CacheFile(path, header, mapped, start)


def remove_interrupted_writes(directory: str | os.PathLike) -> int:
    """Deletes the temporary files of writes that never finished (a kill -9 or a full disk mid-save) -> how many;
    without this each crashed save would leave its partial copy of the cache on disk for ever."""
    removed = 0
    for stale in Path(directory).glob(f"{TMP_PREFIX}*{TMP_SUFFIX}"):
        try:
            stale.unlink()
            removed += 1
        except OSError as e:
            logger.warning("cannot remove %s, left by an interrupted write of the prefix cache: %s", stale, e)
    if removed:
        logger.info("removed %d partial prefix cache file(s) left by an interrupted write in %s", removed, directory)
    return removed


def _check(mapped: mmap.mmap, fingerprint: dict) -> tuple[str | None, dict | None, int]:
    size = len(mapped)
    if size < len(MAGIC) + 8 or mapped[:len(MAGIC)] != MAGIC:
        return "it is not a qnext prefix cache file (corrupted or truncated)", None, 0
    head_len = int.from_bytes(mapped[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8 + head_len + _DIGEST
    if start > size:
        return "it is truncated (in its header)", None, 0
    head = mapped[len(MAGIC) + 8:start - _DIGEST]
    if hashlib.sha256(head).digest() != mapped[start - _DIGEST:start]:
        return "its header is corrupted (checksum mismatch)", None, 0
    header = json.loads(head)
    if header.get("format") != FORMAT_VERSION:
        return f"it has format version {header.get('format')}; this qnext reads {FORMAT_VERSION}", None, 0
    theirs = header.get("fingerprint", {})
    for key, ours in fingerprint.items():
        if theirs.get(key) != ours:
            what = "the model's weights differ" if key == "weights" else f"{key} {theirs.get(key)!r} != {ours!r}"
            return f"it was written for another model or setup ({what})", None, 0
    payload_len = sum(a["nbytes"] for a in header["arrays"])
    if start + payload_len + _DIGEST != size:
        return f"it is truncated or has extra bytes ({size} bytes, expected {start + payload_len + _DIGEST})", None, 0
    digest = hashlib.sha256()
    view = memoryview(mapped)
    for pos in range(start, start + payload_len, 64 << 20):
        digest.update(view[pos:min(pos + (64 << 20), start + payload_len)])
    view.release()
    if digest.digest() != mapped[start + payload_len:]:
        return "its data is corrupted (checksum mismatch)", None, 0
    return None, header, start


def _ignore(path: Path, reason: str) -> None:
    logger.warning("prefix cache file %s is ignored: %s; the cache starts empty and the file is replaced at close",
                   path, reason)
    return None


def _dtype(name: str) -> np.dtype:
    if name in ("bfloat16", "float8_e4m3fn"):
        importlib.import_module("ml_dtypes")     # registers bfloat16 and float8 with numpy
    return np.dtype(name)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:          # some platforms cannot open a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
