"""Qwen3-Next's JSON tool calls (the `hermes` format):

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

The call is accepted once `{"name": "NAME", "arguments": ` is read; the arguments object then streams as it is
written (its raw JSON text), and ends where its braces balance. The call ends at `}` and `</tool_call>`; other text
after the arguments ends it there and goes back to the content."""
from __future__ import annotations

import re

from qnext.agents.tool_parsers.base import CALL_END, Header, ToolCallParser

NAME = re.compile(r"[A-Za-z0-9_.:\-]+")
# The header, as (kind, literal) steps; whitespace is allowed before each step.
_HEADER = (("lit", "{"), ("lit", '"name"'), ("lit", ":"), ("name", ""), ("lit", ","), ("lit", '"arguments"'),
           ("lit", ":"))


def _match(text: str, final: bool) -> tuple[Header, str, int]:
    pos, name = 0, ""
    for kind, lit in _HEADER:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        rest = text[pos:]
        if kind == "lit":
            if rest.startswith(lit):
                pos += len(lit)
                continue
            ok = lit.startswith(rest) and not final
            return (Header.WAIT if ok else Header.NO), "", 0
        if not rest:
            return (Header.NO if final else Header.WAIT), "", 0
        if rest[0] != '"':
            return Header.NO, "", 0
        end = rest.find('"', 1)
        candidate = rest[1:end if end >= 0 else len(rest)]
        if candidate and not NAME.fullmatch(candidate):
            return Header.NO, "", 0
        if end < 0:
            return (Header.NO if final else Header.WAIT), "", 0
        if not candidate:
            return Header.NO, "", 0
        name, pos = candidate, pos + end + 1
    return Header.YES, name, pos


class HermesToolParser(ToolCallParser):
    def match_header(self, text: str, final: bool) -> tuple[Header, str, int]:
        return _match(text, final)

    def begin_body(self, name: str) -> None:
        self._started = False        # the arguments' `{` was read
        self._done = False           # their closing `}` was read
        self._depth = 0
        self._in_string = self._escaped = False

    def read_body(self, text: str, final: bool) -> tuple[list[str], int, bool]:
        if not self._started:
            s = text.lstrip()
            if not s and not final:
                return [], 0, False
            if not s.startswith("{"):
                return ["{}"], len(text) - len(s), True
            self._started = True
            text_start = len(text) - len(s)
        else:
            text_start = 0
        pos = text_start
        if not self._done:
            for pos in range(text_start, len(text) + 1):
                if pos == len(text) or self._done:
                    break
                self._scan(text[pos])
            fragment = text[text_start:pos]
            if not self._done:
                return ([fragment] if fragment else []), len(text), final
            fragments = [fragment] if fragment else []
        else:
            fragments = []
        s = text[pos:].lstrip()
        # After the arguments: `}` then `</tool_call>`.
        if not s and not final:
            return fragments, pos, False
        if s.startswith("}"):
            t = s[1:].lstrip()
            if t.startswith(CALL_END):
                return fragments, len(text) - len(t) + len(CALL_END), True
            if not final and CALL_END.startswith(t):
                return fragments, pos, False
            return fragments, len(text) - len(s) + 1, True
        return fragments, pos, True

    def body_closed(self) -> bool:
        return self._done

    def _scan(self, ch: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._done = True
