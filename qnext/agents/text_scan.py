"""Small helpers for scanning streamed text for markers without splitting one across two deltas."""
from __future__ import annotations

from collections.abc import Sequence

from qnext.tokenizer import partial_stop_length


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest marker in text[start:] -> (index, marker); None if there is none."""
    best = None
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    return best


def settled_length(text: str, markers: Sequence[str], final: bool) -> int:
    """How much of text (that holds no whole marker) can be released: all of it at the end of the output,
    else all but a tail that the next delta could complete into a marker."""
    return len(text) if final else len(text) - partial_stop_length(text, markers)
