"""Value types of command-line flags shared by `qnext serve`'s argument groups."""
from __future__ import annotations

import argparse
import json


def json_object(text: str) -> dict:
    """A flag's JSON object value (vLLM's form: --speculative-config '{"method": "mtp", ...}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
