"""The part every tool-call format shares: content around `<tool_call>...</tool_call>` blocks.

A subclass says whether the text after `<tool_call>` opens a call (`match_header`) and reads the call's body
(`read_body`). The same code serves a whole output (one `feed` and `finish`) and a stream of deltas: a decision is
taken only once the text seen so far settles it, so every way of splitting the output gives the same events.

Content rules: text that starts like a call but is not one (a literal `<tool_call>` in prose, the other format)
stays content, and the parser goes on scanning after it. Whitespace between content and a call, between calls and
after the last call is dropped. Once a call's header is accepted the call is reported even if its body is cut off
(max_tokens): its arguments are then the fragments read so far, and its ToolCallEnd says `complete=False`."""
from __future__ import annotations

import enum
from typing import Callable

from qnext.agents.events import ContentDelta, Event, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from qnext.agents.text_scan import settled_length

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


class Header(enum.Enum):
    WAIT = "wait"       # the text so far could still become a call header
    NO = "no"           # not a call
    YES = "yes"


class ToolCallParser:
    """feed(text) / finish() -> events (ContentDelta and tool-call events) for the content part of an output."""

    def __init__(self, tool_schemas: dict[str, dict], new_call_id: Callable[[], str]):
        self.tool_schemas = tool_schemas        # tool name -> its `parameters` JSON schema
        self._new_call_id = new_call_id
        self._buf = ""
        self._in_call = False
        self._index = -1
        self._args: list[str] = []
        self._held_space = ""                   # trailing whitespace of the content so far, not yet released
        self._after_call = False                # nothing but whitespace since the last call ended

    # ---- for the formats -------------------------------------------------------------------------------------
    def match_header(self, text: str, final: bool) -> tuple[Header, str, int]:
        """text after `<tool_call>` -> (decision, function name, characters of text the header used)."""
        raise NotImplementedError

    def begin_body(self, name: str) -> None:
        raise NotImplementedError

    def read_body(self, text: str, final: bool) -> tuple[list[str], int, bool]:
        """The call's body so far -> (argument fragments now settled, characters consumed, whether the call
        ended). A call ends at `</tool_call>` (consumed) or where its format breaks (left for the content);
        with final, everything left ends it."""
        raise NotImplementedError

    def body_closed(self) -> bool:
        """Whether the call's arguments were closed by the format's own end (asked when the output ends inside
        the call)."""
        raise NotImplementedError

    # ---- the scan ----------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._held_space and not self._after_call:
            events.append(ContentDelta(self._held_space))
        self._held_space = ""
        return events

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._in_call:
                fragments, used, ended = self.read_body(self._buf, final)
                self._buf = self._buf[used:]
                for f in fragments:
                    self._args.append(f)
                    events.append(ToolCallArgsDelta(self._index, f))
                if not ended:
                    return events
                complete = not final or self.body_closed()
                events.append(ToolCallEnd(self._index, "".join(self._args), complete))
                self._in_call, self._after_call = False, True
                continue
            i = self._buf.find(CALL_START)
            if i < 0:
                n = settled_length(self._buf, [CALL_START], final)
                self._content(self._buf[:n], events)
                self._buf = self._buf[n:]
                return events
            self._content(self._buf[:i], events)
            self._buf = self._buf[i:]
            decision, name, used = self.match_header(self._buf[len(CALL_START):], final)
            if decision is Header.WAIT:
                return events
            if decision is Header.NO:
                self._content(CALL_START, events)
                self._buf = self._buf[len(CALL_START):]
                continue
            self._held_space = ""
            self._index += 1
            self._args = []
            self._in_call = True
            events.append(ToolCallStart(self._index, self._new_call_id(), name))
            self._buf = self._buf[len(CALL_START) + used:]
            self.begin_body(name)

    def _content(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        body = text.rstrip()
        if body:
            events.append(ContentDelta(self._held_space + body))
            self._held_space, self._after_call = "", False
        self._held_space += text[len(body):]
