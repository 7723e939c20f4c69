"""Reads float8 tensors from a safetensors file: safetensors' numpy front end writes F8_E4M3 but cannot read it back
(it looks the dtype up on numpy, which has no float8). The format is an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets: [begin, end]}} and the data, offsets counted from the header's end."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from qnext.model.fp8_blocks import e4m3

FLOAT8_DTYPES = {"F8_E4M3": e4m3}


class Float8File:
    """One safetensors file's header, parsed once; `read(name)` returns a float8 tensor as an ml_dtypes array."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (self._header_len,) = struct.unpack("<Q", f.read(8))
            self._header = json.loads(f.read(self._header_len))

    def read(self, name: str) -> np.ndarray:
        entry = self._header.get(name)
        if entry is None:
            raise KeyError(f"tensor {name!r} is not in {self.path}")
        if entry["dtype"] not in FLOAT8_DTYPES:
            raise ValueError(f"tensor {name!r} in {self.path} is {entry['dtype']}, not one of {sorted(FLOAT8_DTYPES)}")
        begin, end = entry["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(8 + self._header_len + begin)
            data = f.read(end - begin)
        return np.frombuffer(data, dtype=FLOAT8_DTYPES[entry["dtype"]]()).reshape(entry["shape"])
