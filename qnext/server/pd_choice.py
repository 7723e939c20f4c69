"""Which prefill and which decode server a request goes to, behind `qnext pd-router` (plain Python, no model).

The router holds no tokenizer, so its notion of a shared prefix is the request's own structure: a chat's messages
(each turn of a conversation resends the earlier ones) or a completion prompt's text in 256-character pieces,
hashed as a chain (key k covers pieces 0..k). The choice among the servers of one role is the server's one prefix
affinity router (prefix_affinity.py, as for data parallel replicas): the server holding the longest run of the
request's chain, since its prefix cache most likely holds the prompt (a decode server then fetches fewer blocks, a
prefill server computes fewer tokens); no match, or a tie: the fewest requests in flight from this router, then the
one chosen least recently.
"""
from __future__ import annotations

import hashlib
import json

from qnext.server.prefix_affinity import PrefixAffinity

TEXT_PIECE = 256        # characters per link of a completion prompt's chain
MAX_KEYS = 100_000      # remembered chain keys per server


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


class ServerPool:
    """The servers of one role behind the router, their requests in flight, and the affinity choice among them. The
    router calls it from its event loop."""

    def __init__(self, urls: list[str], max_keys: int = MAX_KEYS):
        if not urls:
            raise ValueError("at least one server URL is needed")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a server URL is given twice: {urls}")
        self.urls = list(urls)
        self.in_flight = [0] * len(urls)
        self.affinity = PrefixAffinity(len(urls), max_keys, load_of=self.in_flight.__getitem__)

    def choose(self, chain: list[bytes]) -> int:
        """The server for a request with this prefix chain; it is remembered as that server's."""
        return self.affinity.choose(chain)

    def started(self, i: int) -> None:
        self.in_flight[i] += 1

    def finished(self, i: int) -> None:
        self.in_flight[i] -= 1
