"""Agent-facing output handling, independent of any HTTP API: the reasoning parser, tool-call parsers for Qwen3.5
(`qwen3_coder`) and Qwen3-Next (`hermes`), the parser that combines them for one request, and the grammar that
forces a well-formed tool call."""
from qnext.agents.events import (ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCall, ToolCallArgsDelta,
                                 ToolCallEnd, ToolCallStart)
from qnext.agents.output_parser import OutputParser, new_call_id
from qnext.agents.reasoning import REASONING_PARSERS, default_reasoning_parser, prompt_ends_in_reasoning
from qnext.agents.tool_parsers import TOOL_PARSERS, default_tool_parser

__all__ = ["ContentDelta", "Event", "OutputParser", "ParsedOutput", "REASONING_PARSERS", "ReasoningDelta",
           "TOOL_PARSERS", "ToolCall", "ToolCallArgsDelta", "ToolCallEnd", "ToolCallStart",
           "default_reasoning_parser", "default_tool_parser", "new_call_id", "prompt_ends_in_reasoning"]
