"""A deterministic text corpus for training a bench target: the project's own source and documentation.

The files are the sorted `*.py` and `*.md` files under the repository's qnext/, cache/, pallas_kernels/, scripts/,
docs/ and tests/, plus its README.md: what a clean clone holds (the repository root is found from this package, so
nothing outside it is read; caches and build outputs are skipped). The split is by file and by path alone: a file
is held out when the SHA-256 of its POSIX path, as a number, is 0 modulo HELD_OUT_EVERY (about 1 file in 10), so
adding or removing files never moves another file across the split (a target trained before a commit keeps its
held-out files held out after it). Neither the target (scripts/train_bench_target.py) nor the MTP head
(scripts/train_mtp.py --prompt-source corpus) trains on a held-out file. The split is by path, not by content: code
repeated across files (a helper copied into a test) can sit on both sides.

Each split is one token stream: the files' token ids (the checkpoint's tokenizer.json, a byte-level BPE), each file
followed by the tokenizer's end-of-text id. Training windows start at seeded random offsets of the training stream;
held-out prompts at evenly spaced offsets of the held-out stream (no randomness), so every run scores the same
prompts.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

CORPUS_DIRS = ("qnext", "cache", "pallas_kernels", "scripts", "docs", "tests")
CORPUS_SUFFIXES = (".py", ".md")
ROOT_FILES = ("README.md",)
HELD_OUT_EVERY = 10          # about 1 file in 10 is held out (by the hash of its path)
_SKIPPED_PARTS = {"__pycache__", ".pytest_cache", ".hypothesis"}
END_OF_TEXT = "<|endoftext|>"


def repo_root() -> Path:
    """The repository this package sits in (qnext/bench/text_corpus.py -> the directory holding qnext/)."""
    return Path(__file__).resolve().parents[2]


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """The corpus's files, relative to `root`, sorted by their POSIX path (the same order on every machine)."""
    root = Path(root) if root is not None else repo_root()
    files = [Path(name) for name in ROOT_FILES if (root / name).is_file()]
    for d in CORPUS_DIRS:
        for f in (root / d).rglob("*"):
            rel = f.relative_to(root)
            if f.suffix in CORPUS_SUFFIXES and f.is_file() and not _SKIPPED_PARTS & set(rel.parts) \
                    and not any(p.endswith(".egg-info") for p in rel.parts):
                files.append(rel)
    return sorted(files, key=lambda p: p.as_posix())


def is_held_out(path: Path) -> bool:
    """Whether a corpus file (a path relative to the repository) is held out: by its path's hash alone."""
    digest = hashlib.sha256(path.as_posix().encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_EVERY == 0


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), each in the order of `files`: disjoint, together `files`."""
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """The corpus tokenized: `train` and `held_out` int32 token streams, and the files each came from."""

    train: np.ndarray
    held_out: np.ndarray
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]

    def training_windows(self, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """[n, length] windows of the training stream at random offsets drawn from `rng` (seeded by the caller)."""
        return _windows(self.train, rng.integers(0, len(self.train) - length + 1, n), length)

    def training_prompts(self, n: int, length: int, seed: int) -> list[list[int]]:
        """n prompts of `length` tokens from the training stream, at offsets drawn from `seed`."""
        return self.training_windows(n, length, np.random.default_rng(seed)).tolist()

    def held_out_windows(self, n: int, length: int) -> np.ndarray:
        """[n, length] windows of the held-out stream at n evenly spaced offsets (deterministic)."""
        return _windows(self.held_out, np.linspace(0, len(self.held_out) - length, n).astype(np.int64), length)

    def held_out_prompts(self, n: int, length: int) -> list[list[int]]:
        return self.held_out_windows(n, length).tolist()


def _windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    if len(stream) < length:
        raise ValueError(f"a stream of {len(stream)} tokens has no window of {length}")
    return stream[starts[:, None] + np.arange(length)]


def load_tokenizer(checkpoint: str | Path):
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))


def load_corpus(checkpoint: str | Path, root: str | Path | None = None) -> TextCorpus:
    """The corpus of the repository at `root` (default: this one) in the checkpoint's tokenizer."""
    root = Path(root) if root is not None else repo_root()
    tokenizer = load_tokenizer(checkpoint)
    eot = tokenizer.token_to_id(END_OF_TEXT)
    if eot is None:
        raise ValueError(f"{checkpoint}'s tokenizer has no {END_OF_TEXT} token to separate files")
    train, held = split_files(corpus_files(root))

    def stream(files: list[Path]) -> np.ndarray:
        texts = [(root / f).read_text(encoding="utf-8", errors="replace") for f in files]
        ids = [e.ids + [eot] for e in tokenizer.encode_batch(texts)]   # batch encode is order-preserving
        return np.array([t for file_ids in ids for t in file_ids], np.int32)

    return TextCorpus(stream(train), stream(held), tuple(f.as_posix() for f in train),
                      tuple(f.as_posix() for f in held))
