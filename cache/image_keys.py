"""What a block's hash adds for the image (or video) tokens it holds (plain Python, no jax).

A placeholder token (`<|image_pad|>`) says nothing about the picture, so two prompts with the same text and
different images have equal token ids. Every block that holds placeholder tokens therefore mixes into its chain
hash, for each image span it overlaps: the image's full content hash (SHA-256 of the decoded pixels plus the
processing parameters, 32 bytes; never a shortened one) and where the span lies relative to the block. A block
with no image tokens hashes exactly as before, so text-only traffic keys the same with or without a vision tower.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Sequence

CONTENT_HASH_BYTES = 32          # SHA-256


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """One image's (or video's) placeholder tokens in a prompt: positions [start, start + length)."""
    start: int
    length: int
    content_hash: bytes

    def __post_init__(self):
        if len(self.content_hash) != CONTENT_HASH_BYTES:
            raise ValueError(f"an image's content hash must be the full SHA-256 ({CONTENT_HASH_BYTES} bytes), got "
                             f"{len(self.content_hash)} bytes; pass hashlib.sha256(...).digest()")
        if self.start < 0 or self.length <= 0:
            raise ValueError(f"image span [{self.start}, {self.start + self.length}) must start at >= 0 and hold "
                             "at least one token")

    @property
    def end(self) -> int:
        return self.start + self.length


def block_image_keys(images: Sequence[ImageSpan], block_start: int, block_end: int) -> bytes:
    """The bytes that the images overlapping tokens [block_start, block_end) add to that block's hash: per image,
    its content hash, its start relative to the block (negative: it began in an earlier block) and its length.
    b"" when the block holds no image token."""
    keys = b""
    for span in images:
        if span.start < block_end and span.end > block_start:
            keys += span.content_hash + struct.pack("<qq", span.start - block_start, span.length)
    return keys


def check_image_spans(images: Sequence[ImageSpan], prompt_len: int) -> tuple[ImageSpan, ...]:
    """The spans, checked: inside the prompt, in order, not overlapping."""
    spans = tuple(images)
    end = 0
    for span in spans:
        if span.start < end or span.end > prompt_len:
            raise ValueError(f"image spans must be ordered, disjoint and inside the {prompt_len}-token prompt; got "
                             f"{[(s.start, s.end) for s in spans]}")
        end = span.end
    return spans
