"""Shared by the tests/test_flax_*.py files: one perturbed tiny transformers checkpoint per family, built once per
session, and one jitted forward, so every file reuses the same compilations."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx

from tests.support.hf_reference import FULL, LIN, build_hf_model, save_hf_model

PAD = 5
LENGTH = 70              # two chunks of the delta rule


@functools.lru_cache(maxsize=None)
def hf_checkpoint(family: str):
    """(transformers model, checkpoint directory it saved). Three layers: DeltaNet + MoE, attention + MoE, DeltaNet +
    dense MLP for qwen3_next (its layer 2 is dense), dense MLPs for qwen3_5, MoE for qwen3_5_moe."""
    root = Path(tempfile.mkdtemp(prefix=f"qnext-flax-{family}-"))
    atexit.register(shutil.rmtree, root, True)
    hf = build_hf_model(family, seed=7, num_hidden_layers=3, layer_types=[LIN, FULL, LIN])
    return hf, save_hf_model(hf, root)


forward = nnx.jit(lambda model, input_ids, attention_mask: model(input_ids, attention_mask))


def left_padded_batch(vocab_size: int, seed: int = 0):
    """ids [2, LENGTH] int32 and mask: row 0 is a prompt, row 1 is PAD random padding tokens + the prompt's first
    LENGTH - PAD tokens."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab_size, LENGTH)
    ids = np.stack([prompt, np.concatenate([rng.integers(0, vocab_size, PAD), prompt[:-PAD]])]).astype(np.int32)
    mask = np.ones(ids.shape, np.int32)
    mask[1, :PAD] = 0
    return ids, mask
