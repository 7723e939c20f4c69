"""Qwen3.5's XML tool calls (vLLM's `qwen3_coder`):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text with one newline after `<parameter=KEY>` and one before `</parameter>` (both dropped); they
become JSON with the tool's schema types. A value ends at `</parameter>`, or at a tag that shows the closing tag was
left out (`<parameter=`, `</function>`, `</tool_call>`), or at the end of the output. String values stream as they
are written; other values are reported when they end. Text between parameters that is not a tag is ignored."""
from __future__ import annotations

import json
import re

from qnext.agents.text_scan import find_first, settled_length
from qnext.agents.tool_parsers.base import CALL_END, Header, ToolCallParser
from qnext.agents.tool_parsers.schema_values import schema_types, value_to_json

FUNCTION_START = "<function="
PARAM_START, PARAM_END, FUNCTION_END = "<parameter=", "</parameter>", "</function>"
NAME = re.compile(r"[A-Za-z0-9_.:\-]+")
_BODY_TAGS = (PARAM_START, FUNCTION_END, CALL_END)
_VALUE_ENDS = (PARAM_END, PARAM_START, FUNCTION_END, CALL_END)


class Qwen3CoderToolParser(ToolCallParser):
    def match_header(self, text: str, final: bool) -> tuple[Header, str, int]:
        s = text.lstrip()
        skipped = len(text) - len(s)
        if len(s) < len(FUNCTION_START):
            return (Header.WAIT if FUNCTION_START.startswith(s) and not final else Header.NO), "", 0
        if not s.startswith(FUNCTION_START):
            return Header.NO, "", 0
        end = s.find(">", len(FUNCTION_START))
        name = s[len(FUNCTION_START):end if end >= 0 else len(s)]
        if name and not NAME.fullmatch(name):
            return Header.NO, "", 0
        if end < 0:
            return (Header.NO if final else Header.WAIT), "", 0
        if not name:
            return Header.NO, "", 0
        return Header.YES, name, skipped + end + 1

    def begin_body(self, name: str) -> None:
        self._properties = (self.tool_schemas.get(name) or {}).get("properties") or {}
        self._key: str | None = None            # the parameter whose value is being read
        self._after_function = False
        self._num_params = 0

    def read_body(self, text: str, final: bool) -> tuple[list[str], int, bool]:
        fragments: list[str] = []
        pos = 0
        while True:
            rest = text[pos:]
            if self._after_function:
                s = rest.lstrip()
                if s.startswith(CALL_END):
                    return self._close(fragments), len(text) - len(s) + len(CALL_END), True
                if not final and CALL_END.startswith(s):
                    return fragments, pos, False
                return self._close(fragments), pos, True
            if self._key is not None:
                found = find_first(rest, _VALUE_ENDS)
                if found is None and not final:
                    if self._text_value:            # release the settled part of a string value
                        n = settled_length(rest, _VALUE_ENDS, False)
                        chunk = self._value_text(rest[:n].removesuffix("\n"), last=False)
                        if chunk is not None:
                            fragments.append(chunk)
                            pos += len(rest[:n].removesuffix("\n"))
                    return fragments, pos, False
                value = rest if found is None else rest[:found[0]]
                fragments.append(self._value_end(value))
                self._key = None
                if found is None:
                    return self._close(fragments), len(text), True
                pos += found[0] + (len(PARAM_END) if found[1] == PARAM_END else 0)
                continue
            found = find_first(rest, _BODY_TAGS)
            if found is None:
                if final:
                    return self._close(fragments), len(text), True
                return fragments, pos + settled_length(rest, _BODY_TAGS, False), False
            i, tag = found
            if tag == CALL_END:
                return self._close(fragments), pos + i + len(CALL_END), True
            if tag == FUNCTION_END:
                self._after_function = True
                pos += i + len(FUNCTION_END)
                continue
            end = rest.find(">", i)
            if end < 0:
                if final:
                    return self._close(fragments), len(text), True
                return fragments, pos + i, False
            self._key = rest[i + len(PARAM_START):end].strip()
            self._begin_value()
            pos += end + 1

    def body_closed(self) -> bool:
        return self._after_function

    # A string value (the schema says string, or does not declare the parameter) streams as it is written: the
    # key and the opening quote first, then escaped text as it settles (a trailing newline is held back: it may be
    # the one before `</parameter>`), then the closing quote. Other values are converted once they end.
    def _begin_value(self) -> None:
        self._num_params += 1
        self._head = ("{" if self._num_params == 1 else ", ") + json.dumps(self._key, ensure_ascii=False) + ": "
        self._text_value = schema_types(self._properties.get(self._key)) in ([], ["string"])
        self._value_started = False         # the newline after `<parameter=KEY>` was looked for

    def _value_text(self, text: str, last: bool) -> str | None:
        """Escaped string text (with the key and quote before the first piece); None: nothing settled yet."""
        head = ""
        if not self._value_started:
            if not text and not last:
                return None
            text = text.removeprefix("\n")
            head, self._value_started = self._head + '"', True
        escaped = json.dumps(text, ensure_ascii=False)[1:-1]
        return (head + escaped) if (head or escaped) else None

    def _value_end(self, value: str) -> str:
        if not self._text_value:
            value = value.removeprefix("\n").removesuffix("\n")
            return self._head + value_to_json(value, self._properties.get(self._key))
        return (self._value_text(value.removesuffix("\n"), last=True) or "") + '"'

    def _close(self, fragments: list[str]) -> list[str]:
        fragments.append("}" if self._num_params else "{}")
        return fragments
