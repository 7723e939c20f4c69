"""A byte-level BPE tokenizer of any vocabulary size (Qwen3.5's is ~248k) for measuring grammar masks, where no
real one can be downloaded.

What a grammar library's mask cost depends on is the set of token byte strings (its token trie: how many tokens,
how long, which bytes they start with), not the merges. This vocabulary is built like a large multilingual BPE
one: the 256 byte tokens, then English-like words with and without a leading space (the bulk of a real vocabulary),
capitalised words, digit runs, punctuation and code fragments, whitespace runs (indentation) and CJK / accented
words (multi-byte UTF-8), drawn from a fixed seed. Tokenizing text gives bytes and the longest vocabulary pieces
a greedy pass finds (no merges), which is all a mask benchmark needs: the mask walks the trie, not the merges.
"""
from __future__ import annotations

import json

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

_LOWER = "etaoinshrdlcumwfgypbvkjxqz"
_FREQ = np.array([12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0, 1.9,
                  1.5, 1.0, 0.8, 0.15, 0.15, 0.1, 0.07])
_PUNCT = list(".,;:!?'\"()[]{}<>-_=+*/\\|&^%$#@~`")
_CODE = ["()", "();", "{}", "[]", "=>", "->", "==", "!=", "<=", ">=", "::", "//", "/*", "*/", "\"\"", "''", "):",
         "self", "def", "return", "import", "const", "function", "\\n", "\\t", "\":", "\",", "\"}"]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (ByteLevel's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def synthetic_vocabulary(vocab_size: int, seed: int = 0, num_special: int = 26) -> list[str]:
    """vocab_size - 256 - num_special distinct token strings (text, not byte-level encoded)."""
    rng = np.random.default_rng(seed)
    target = vocab_size - 256 - num_special
    letters = iter(rng.choice(list(_LOWER), size=40 * target + 1000, p=_FREQ / _FREQ.sum()).tolist())
    ints = iter(rng.integers(0, 1 << 30, size=8 * target + 1000).tolist())
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 6000)]
    accented = [chr(c) for c in range(0xC0, 0x17F)]

    def n(lo, hi):
        return lo + next(ints) % (hi - lo + 1)

    def word(lo=2, hi=10):
        return "".join(next(letters) for _ in range(n(lo, hi)))

    def pick(pool, lo, hi):
        return "".join(pool[next(ints) % len(pool)] for _ in range(n(lo, hi)))

    tokens: dict[str, None] = {}
    while len(tokens) < target:
        kind = next(ints) % 100
        if kind < 40:
            t = " " + word()
        elif kind < 62:
            t = word()
        elif kind < 70:
            t = " " + word().capitalize()
        elif kind < 74:
            t = pick("0123456789", 1, 3)
        elif kind < 79:
            t = pick(_PUNCT, 1, 3)
        elif kind < 83:
            t = _CODE[next(ints) % len(_CODE)] + word(0, 3)
        elif kind < 86:
            t = " \n\t"[next(ints) % 3] * n(2, 16)
        elif kind < 95:
            t = pick(cjk, 1, 3)
        else:
            t = word(1, 4) + pick(accented, 1, 2) + word(0, 3)
        tokens[t] = None
    return list(tokens)


def synthetic_tokenizer(vocab_size: int, seed: int = 0, num_special: int = 26) -> tokenizers.Tokenizer:
    """A tokenizers.Tokenizer (byte-level BPE, no merges) with exactly vocab_size tokens; the last num_special are
    special tokens, the first of them <|endoftext|>."""
    enc = _byte_to_unicode()
    vocab = {enc[b]: b for b in range(256)}
    for t in synthetic_vocabulary(vocab_size, seed, num_special):
        key = "".join(enc[b] for b in t.encode("utf-8"))
        if key not in vocab:
            vocab[key] = len(vocab)
    n = 0
    while len(vocab) < vocab_size - num_special:          # encoded collisions (rare): pad with more words
        vocab.setdefault(f"ĠpadĠ{n}", len(vocab))
        n += 1
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"] + [f"<|special_{i}|>" for i in range(num_special - 1)])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def tokenizer_json(vocab_size: int, seed: int = 0) -> str:
    return synthetic_tokenizer(vocab_size, seed).to_str()


if __name__ == "__main__":       # a quick look at the vocabulary
    tok = synthetic_tokenizer(248_320)
    print(tok.get_vocab_size(), json.dumps(tok.encode(" the quick brown fox {\"a\": 1}").tokens))
