"""A reduced draft vocabulary for the MTP head (SGLang's `--speculative-token-map`, FR-Spec's frequency-ranked
drafting): the head's drafts are the argmax over a list of frequent token ids instead of the whole vocabulary.

Every draft reads the lm_head once at one row, so at batch 1 its cost is the lm_head's read: V x H weights (Qwen3.5's
248,320-token vocabulary at hidden 2048 is 508M of them, several times what the head's own layer reads). Drafting
over the N most frequent tokens of the target's output reads N x H. A token outside the map is never drafted, so
such a position is rejected where the full head might have drafted it; the target still verifies every draft, so
output tokens and the sampled distribution are unchanged (rejection sampling against a one-hot draft keeps the
target's distribution whatever chose the draft).

The map is a file of distinct token ids, most frequent first: `.npy` (a 1-D integer array) or `.json` (a list of
integers). `scripts/train_mtp.py --token-map-size N` writes one from the target's own greedy continuations.
"""
from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Iterable

import numpy as np

TOKEN_MAP_FILE = "mtp_token_map.npy"


def load_token_map(path: str | Path, vocab_size: int) -> np.ndarray:
    """The token ids of a map file, int32 [N], checked: 1-D, integers, distinct, in [0, vocab_size)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"speculative_token_map {str(path)!r} is not a file")
    if path.suffix == ".npy":
        ids = np.load(path, allow_pickle=False)
    elif path.suffix == ".json":
        ids = np.asarray(json.loads(path.read_text()))
    else:
        raise ValueError(f"speculative_token_map {str(path)!r}: expected a .npy array or a .json list of token ids")
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"speculative_token_map {str(path)!r} must hold a non-empty list of integer token ids, got "
                         f"shape {ids.shape} of {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"speculative_token_map {str(path)!r} has ids outside the vocabulary [0, {vocab_size}): "
                         f"{bad[:5].tolist()}")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"speculative_token_map {str(path)!r} lists a token id more than once")
    return ids.astype(np.int32)


def frequent_tokens(sequences: Iterable[Iterable[int]], size: int) -> np.ndarray:
    """The `size` most frequent ids of `sequences` (fewer if fewer occur), most frequent first, ties by id."""
    counts = collections.Counter(int(t) for seq in sequences for t in seq)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return np.asarray([t for t, _ in ranked[:size]], np.int32)


def coverage(token_map: np.ndarray, sequences: Iterable[Iterable[int]]) -> float:
    """The fraction of the tokens of `sequences` that the map holds (the share a map-restricted head can draft)."""
    held = set(token_map.tolist())
    tokens = [int(t) for seq in sequences for t in seq]
    return sum(t in held for t in tokens) / len(tokens) if tokens else 0.0
