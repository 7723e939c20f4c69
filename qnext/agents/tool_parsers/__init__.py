"""Tool-call parsers by vLLM's names: `qwen3_coder` (Qwen3.5's XML calls) and `hermes` (Qwen3-Next's JSON calls)."""
from __future__ import annotations

from qnext.agents.tool_parsers.base import ToolCallParser
from qnext.agents.tool_parsers.hermes import HermesToolParser
from qnext.agents.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {"qwen3_coder": Qwen3CoderToolParser, "hermes": HermesToolParser}


def default_tool_parser(chat_template: str | None) -> str | None:
    """The format a chat template renders tool calls in: `qwen3_coder` for `<function=...>` calls, `hermes` for
    JSON calls in `<tool_call>`, None for a template without tool calls."""
    if not chat_template or "<tool_call>" not in chat_template:
        return None
    return "qwen3_coder" if "<function=" in chat_template else "hermes"


__all__ = ["TOOL_PARSERS", "ToolCallParser", "default_tool_parser"]
