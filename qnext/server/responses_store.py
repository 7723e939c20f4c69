"""previous_response_id: the conversations of the last `capacity` responses, in memory (least recently used
goes first). Nothing survives a restart; a miss is the caller's 400."""
from __future__ import annotations

import collections
import threading

from qnext.server.responses_request import conversation_messages


class ResponseStore:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"the response store needs room for at least one response, got {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict], output_items: list[dict]) -> None:
        """messages: the chat messages the response answered; output_items: its output."""
        conversation = list(messages) + conversation_messages(output_items)
        with self._lock:
            self._entries[response_id] = conversation
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        """The conversation so far (chat messages, its output included), or None."""
        with self._lock:
            conversation = self._entries.get(response_id)
            if conversation is not None:
                self._entries.move_to_end(response_id)
            return conversation
