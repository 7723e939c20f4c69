"""The llguidance view of a checkpoint's tokenizer: every id's bytes, and which ids are special.

llguidance's own tokenizer.json reader marks EVERY added token as special (its bytes get a 0xFF marker, so no text
in a grammar matches it). Qwen's tokenizers add `<tool_call>`, `</tool_call>`, `<think>`, `</think>`, ... as tokens
that are NOT special: the model writes a tool call as the one token `<tool_call>`, which decodes as that text. Read
by llguidance's reader, a grammar whose text is `<tool_call>...` offers that token in its mask and then refuses it
when it is sampled (a dead end on every forced call). So qnext hands llguidance the tokens itself: byte-level BPE
strings mapped back to bytes, added tokens as their text, and only the tokens the tokenizer calls special marked
special. Ids past the tokenizer's (rows that pad the embedding) are special placeholders no grammar allows.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import tokenizers


def bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's map (GPT-2's): byte -> the printable character that stands for it in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class _Tokens:
    """What llguidance's TokenizerWrapper reads: tokens (bytes per id), special_token_ids, eos / bos, and a call
    that encodes text (used for the forced parts of a grammar)."""

    def __init__(self, backend: tokenizers.Tokenizer, vocab_size: int, eos_token_id: int):
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        added = backend.get_added_tokens_decoder()
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(vocab_size):
            if i in added:
                self.tokens.append(added[i].content.encode())
                if added[i].special:
                    self.special_token_ids.append(i)
                continue
            piece = backend.id_to_token(i)
            if piece is None:
                self.tokens.append(f"<|qnext_unused_{i}|>".encode())
                self.special_token_ids.append(i)
            else:
                self.tokens.append(bytes(byte_of[c] for c in piece))
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self._backend = backend

    def __call__(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids


def is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    """The decoder is byte-level (alone or in a sequence)."""
    if backend.decoder is None:
        return False
    decoder = json.loads(backend.decoder.__getstate__())
    return "ByteLevel" in [d.get("type") for d in decoder.get("decoders", [decoder])]


def llguidance_tokenizer(backend: tokenizers.Tokenizer, vocab_size: int,
                         eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """An LLTokenizer over `vocab_size` ids (the model's, padding rows included) that sees non-special added tokens
    as the text they decode to. Byte-level BPE tokenizers (every Qwen's) only; others go through llguidance's own
    reader."""
    if not is_byte_level(backend):
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
    wrapper = llguidance.TokenizerWrapper(_Tokens(backend, vocab_size, eos_token_ids[0]))
    return llguidance.LLTokenizer(wrapper, eos_token=list(eos_token_ids))
