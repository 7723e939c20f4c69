"""Model size presets of the benchmarks (scripts/bench.py): random checkpoints written with `write_tiny_checkpoint`.

- tiny, tiny-moe, tiny-next: the test configs (hidden 64, 4 layers); per-step Python overhead dominates.
- small: real Qwen3.5 head dims (attention head_dim 256, linear key/value head dim 128, 16 value heads over 8 key
  heads), 3 linear + 1 full attention layer, hidden 1024; about 80M parameters (157 MFLOP per token), big enough
  that matmuls, not Python, dominate a CPU step. Its vocabulary is 8,192 ids.
- small-248k: small with Qwen3.5's real tokenizer and vocabulary (248,320 ids; embedding tied to the lm_head, which
  halves the checkpoint, 1.3 GB in float32): the lm_head (254M parameters, 3.2x the rest of the model), the logits
  and the sampler at the real model's size, which small makes ~30x cheaper. `small`'s figures stay comparable
  run to run; this one says what the vocabulary costs.

`<name>-lm` (lm_checkpoint_dir) is a preset's checkpoint with its decoder trained as a language model on the
project's own text (scripts/train_bench_target.py, qnext/bench/text_corpus.py): same config and tokenizer, a target
whose next token is predictable, for measuring speculative decoding at the acceptance a trained head reaches.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

LIN, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class BenchModel:
    name: str
    family: str
    overrides: dict[str, Any]
    max_num_batched_tokens: int     # prefill token budget per step


_LONG = {"max_position_embeddings": 4096}   # room for multi-turn chats; compute does not depend on it
_SMALL = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL],
              num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=8,
              linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)

PRESETS = {
    "tiny": BenchModel("tiny", "qwen3_5", dict(_LONG), 1024),
    "tiny-moe": BenchModel("tiny-moe", "qwen3_5_moe", dict(_LONG), 1024),
    "tiny-next": BenchModel("tiny-next", "qwen3_next", dict(_LONG), 1024),
    "small": BenchModel("small", "qwen3_5", dict(_LONG, vocab_size=8192, **_SMALL), 1024),
    "small-248k": BenchModel("small-248k", "qwen3_5", dict(_LONG, tokenizer="qwen3.5", tie_word_embeddings=True,
                                                           **_SMALL), 1024),
}
_VERSION = 1  # bump when a preset changes so cached checkpoints are rewritten


def bench_checkpoint(name: str, root: str | Path) -> Path:
    """The preset's float32 checkpoint under `root` (written once, then reused; engines cast at load)."""
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is not one of {sorted(PRESETS)}")
    preset = PRESETS[name]
    path = Path(root) / f"{name}-v{_VERSION}"
    if not (path / "config.json").is_file():
        write_tiny_checkpoint(path, preset.family, seed=0, **preset.overrides)
    return path


def lm_checkpoint_dir(name: str, root: str | Path) -> Path:
    """Where scripts/train_bench_target.py writes the preset's trained-target checkpoint (`<root>/<name>-lm`)."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is not one of {sorted(PRESETS)}")
    return Path(root) / f"{name}-lm"


def is_lm_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a trained-target checkpoint of lm_checkpoint_dir (its prompts come from the text corpus)."""
    return Path(path).name.endswith("-lm")
