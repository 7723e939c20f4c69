"""The Qwen3 reasoning parser (`--reasoning-parser qwen3`).

Qwen3 / Qwen3.5 thinking templates end the prompt inside `<think>`: the output starts as reasoning and `</think>`
ends it; whitespace right after `</think>` is dropped (the template puts `\\n\\n` there). With a prompt that does
not end inside `<think>` (thinking off, or an instruct template) the whole output is content."""
from __future__ import annotations

from qnext.agents.text_scan import settled_length

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3",)


def prompt_ends_in_reasoning(prompt: str) -> bool:
    """Whether the generation prompt leaves the model inside `<think>` (looked for in the last turn only)."""
    last_turn = prompt[prompt.rfind("<|im_start|>"):]
    i = last_turn.rfind(THINK_START)
    return i >= 0 and THINK_END not in last_turn[i:]


def default_reasoning_parser(chat_template: str | None) -> str | None:
    """`qwen3` for a template that opens `<think>`, else None."""
    return "qwen3" if chat_template and THINK_START in chat_template else None


class Qwen3ReasoningParser:
    """feed(text) / finish() -> [(is_reasoning, text)], in output order."""

    def __init__(self, starts_in_reasoning: bool):
        self.in_reasoning = starts_in_reasoning
        self._buf = ""
        self._skip_whitespace = False

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[tuple[bool, str]]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple[bool, str]]:
        out = []
        if self.in_reasoning:
            i = self._buf.find(THINK_END)
            if i < 0:
                n = settled_length(self._buf, [THINK_END], final)
                if n:
                    out.append((True, self._buf[:n]))
                self._buf = self._buf[n:]
                return out
            if i:
                out.append((True, self._buf[:i]))
            self._buf = self._buf[i + len(THINK_END):]
            self.in_reasoning, self._skip_whitespace = False, True
        if self._skip_whitespace:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._skip_whitespace = False
        if self._buf:
            out.append((False, self._buf))
            self._buf = ""
        return out
