"""Reading a safetensors checkpoint by tensor name: single-file or sharded, the VLM prefix `model.language_model.`
stripped, the vision tower and MTP head skipped (they have their own loaders), shapes and FP8 block scales checked
(fp8_blocks.py), and every tensor accounted for."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np

from qnext.config import read_json
from qnext.model.fp8_blocks import Fp8Scheme, bad_scales, dequantize, quantization_problem, scale_name
from qnext.model.safetensors_fp8 import FLOAT8_DTYPES, Float8File

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_VLM_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, unexpected or mis-shaped tensors, missing files."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (from the index when sharded)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    index = path / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"shard {f.name} listed in {index} is missing from {path}")
        return files
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise CheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")


class Tensors:
    """Name -> tensor over all files, with the VLM prefix stripped and skipped names dropped; tracks use."""

    def __init__(self, path: Path):
        self._path = path
        self._files = checkpoint_files(path)
        self._stack = contextlib.ExitStack()
        self._where: dict[str, tuple[Any, str, str]] = {}  # name -> (handle, original name, file name)
        self._used: set[str] = set()
        config = path / "config.json"
        self._fp8 = Fp8Scheme.from_hf_config(read_json(config)) if config.is_file() else None
        self._float8_files: dict[str, Float8File] = {}  # file name -> header, for the fp8 tensors' reads

    def __enter__(self) -> "Tensors":
        from safetensors import safe_open

        for f in self._files:
            try:
                handle = self._stack.enter_context(safe_open(str(f), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read {f}: {e}") from None
            for original in handle.keys():
                if original.startswith(_SKIPPED_PREFIXES):
                    continue
                name = "model." + original[len(_VLM_PREFIX):] if original.startswith(_VLM_PREFIX) else original
                if name in self._where:
                    raise CheckpointError(f"tensor {original!r} appears twice (in {self._where[name][2]} and {f.name})")
                self._where[name] = (handle, original, f.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self._where

    def check(self, sources: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        """Each named tensor exists with the given shape; marks them used."""
        for name, shape in sources:
            if name not in self._where:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self._path}")
            handle, original, file = self._where[name]
            got = tuple(handle.get_slice(original).get_shape())
            if got != tuple(shape):
                raise CheckpointError(
                    f"tensor {original!r} in {file} has shape {got}; the config expects {tuple(shape)}"
                )
            self._check_quantization(name, got, handle.get_slice(original).get_dtype())
            self._used.add(name)

    def _check_quantization(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        """fp8_blocks.quantization_problem, as a CheckpointError naming the tensor; a checked scale is marked used."""
        _, original, file = self._where[name]
        scale = self._where.get(scale_name(name))
        scale_shape = None if scale is None else tuple(scale[0].get_slice(scale[1]).get_shape())
        problem = quantization_problem(self._fp8, name, shape, dtype, dtype in FLOAT8_DTYPES, scale_shape)
        if problem:
            raise CheckpointError(f"tensor {original!r} in {file} {problem}")
        if dtype in FLOAT8_DTYPES:
            self._used.add(scale_name(name))

    def read(self, name: str) -> np.ndarray:
        handle, original, file = self._where[name]
        if handle.get_slice(original).get_dtype() not in FLOAT8_DTYPES:
            return handle.get_tensor(original)
        return dequantize(*self.read_fp8(name), self._fp8.block_size)

    def is_fp8(self, name: str) -> bool:
        handle, original, _ = self._where[name]
        return handle.get_slice(original).get_dtype() in FLOAT8_DTYPES

    @property
    def fp8_block_size(self) -> tuple[int, int] | None:
        return None if self._fp8 is None else self._fp8.block_size

    def read_fp8(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """An fp8 tensor as stored: (e4m3 values, float32 block scales); CheckpointError naming the scale when one
        is NaN, zero, negative or infinite."""
        handle, original, file = self._where[name]
        if file not in self._float8_files:
            self._float8_files[file] = Float8File(self._path / file)
        s_handle, s_original, s_file = self._where[scale_name(name)]
        scales = s_handle.get_tensor(s_original).astype(np.float32)
        problem = bad_scales(scales)
        if problem:
            raise CheckpointError(f"block scale {s_original!r} in {s_file} of fp8 tensor {original!r} {problem}")
        return self._float8_files[file].read(original), scales

    def check_all_used(self) -> None:
        unused = [n for n in self._where if n not in self._used]
        if unused:
            _, original, file = self._where[unused[0]]
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            raise CheckpointError(
                f"unexpected tensor {original!r} in {file}{more}; does the config match the checkpoint?"
            )
