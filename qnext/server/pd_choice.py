"""Which prefill and which decode server a request goes to, behind `qnext pd-router` (plain Python, no model).

The router holds no tokenizer, so its notion of a shared prefix is the request's own structure: a chat's messages
(each turn of a conversation resends the earlier ones) or a completion prompt's text in 256-character pieces,
hashed as a chain (key k covers pieces 0..k). Each instance remembers the chains it was sent; a request goes to the
instance whose chain matches it deepest, since that server's prefix cache most likely holds its prompt (a decode
server then fetches fewer blocks, a prefill server computes fewer tokens). No match, or a tie: the instance with
the fewest requests in flight from this router, then the one chosen least recently. A chain's memory is bounded
(least recently used keys forgotten first); it is a hint, never a correctness matter: any instance serves any
request.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

TEXT_PIECE = 256        # characters per link of a completion prompt's chain
MAX_KEYS = 100_000      # remembered chain keys per router role


def prefix_chain(body: dict) -> list[bytes]:
    """Chained keys of a request body's prefix: one per chat message, or per 256 characters of a prompt."""
    if isinstance(body.get("messages"), list):
        pieces = [json.dumps(m, sort_keys=True, separators=(",", ":")) for m in body["messages"]]
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
        pieces = [text[i:i + TEXT_PIECE] for i in range(0, len(text), TEXT_PIECE)]
    else:
        pieces = [json.dumps(body.get("prompt"), separators=(",", ":"))]
    head = json.dumps([body.get("model"), body.get("tools")], sort_keys=True, separators=(",", ":"))
    chain, key = [], hashlib.blake2b(head.encode(), digest_size=16).digest()
    for piece in pieces:
        key = hashlib.blake2b(key + piece.encode(), digest_size=16).digest()
        chain.append(key)
    return chain


class InstanceChooser:
    """Cache-affine choice among the servers of one role (see the module docstring). Not thread-safe: the router
    calls it from its event loop."""

    def __init__(self, urls: list[str], max_keys: int = MAX_KEYS):
        if not urls:
            raise ValueError("at least one server URL is needed")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a server URL is given twice: {urls}")
        self.urls = list(urls)
        self.in_flight = [0] * len(urls)
        self._last_chosen = [0] * len(urls)
        self._clock = 0
        self._owner: OrderedDict[bytes, int] = OrderedDict()   # chain key -> the instance last sent it
        self.max_keys = max_keys

    def choose(self, chain: list[bytes]) -> int:
        """The instance for a request with this prefix chain; remembers the chain as that instance's."""
        best = None
        for key in chain:
            owner = self._owner.get(key)
            if owner is None:
                break
            best = owner
        if best is None:
            best = min(range(len(self.urls)), key=lambda i: (self.in_flight[i], self._last_chosen[i]))
        self._clock += 1
        self._last_chosen[best] = self._clock
        for key in chain:
            self._owner[key] = best
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)
        return best

    def started(self, i: int) -> None:
        self.in_flight[i] += 1

    def finished(self, i: int) -> None:
        self.in_flight[i] -= 1
