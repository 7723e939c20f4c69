"""Suffix drafting's memory (docs/speculative.md, "Suffix and n-gram drafting"): per running request an index of its
prompt and output (suffix_index.SuffixIndex, dropped when the request ends), and one index of the outputs of recent
requests, running and finished, bounded by vLLM's suffix_decoding_max_cached_requests and a token budget: the
request updated least recently goes first (LRU). A proposal is the better of the request's own index and the
shared one (by suffix decoding's score)."""
from __future__ import annotations

from collections import OrderedDict

from qnext.engine.suffix_index import NO_PROPOSAL, Proposal, SuffixIndex

DEFAULT_MAX_CACHED_TOKENS = 1 << 18     # shared index: about 200-300 bytes of Python objects a token


class SuffixCache:
    def __init__(self, max_cached_requests: int, max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
                 key_lengths: tuple[int, ...] = (2, 4, 8)):
        if max_cached_requests < 0 or max_cached_tokens < 0:
            raise ValueError(f"max_cached_requests and max_cached_tokens must be >= 0, got {max_cached_requests}, "
                             f"{max_cached_tokens}")
        self.max_cached_requests, self.max_cached_tokens = max_cached_requests, max_cached_tokens
        self.key_lengths = key_lengths
        self.local: dict[str, SuffixIndex] = {}
        self.shared = SuffixIndex(key_lengths)
        self._recent: OrderedDict[str, None] = OrderedDict()   # shared index's requests, least recent first

    def context(self, request_id: str) -> list[int]:
        """The request's prompt and output as last updated (the local index's sequence; do not modify)."""
        return self.local[request_id].sequences[request_id]

    def update(self, request_id: str, prompt: list[int], output: list[int]) -> list[int]:
        """Brings the request's own index to prompt + output (appending what is new) and its new output tokens
        into the shared index; evicts least recent requests from the shared index past its bounds. Returns the
        request's context."""
        index = self.local.get(request_id)
        if index is None:
            index = self.local[request_id] = SuffixIndex(self.key_lengths)
            index.extend(request_id, prompt)
        seq = index.sequences[request_id]
        have = len(seq) - len(prompt)
        if have < 0 or seq[len(prompt):] != output[:have]:       # not a continuation: start over
            index.remove(request_id)
            index.extend(request_id, prompt)
            have = 0
        new = output[have:]
        index.extend(request_id, new)
        if self.max_cached_requests and self.max_cached_tokens and new:
            self.shared.extend(request_id, new)
            self._recent[request_id] = None
            self._recent.move_to_end(request_id)
            self._evict()
        return index.sequences[request_id]

    def _evict(self) -> None:
        while self._recent and (len(self._recent) > self.max_cached_requests
                                or self.shared.num_tokens > self.max_cached_tokens):
            oldest, _ = self._recent.popitem(last=False)
            self.shared.remove(oldest)

    def free(self, request_id: str) -> None:
        """The request ended: its own index goes; its output stays in the shared index until evicted."""
        self.local.pop(request_id, None)

    def speculate(self, request_id: str, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
                  max_depth: int) -> Proposal:
        """The better proposal of the request's own index and the shared one (which leaves the request out: its
        output is in its own index already)."""
        context = self.context(request_id)
        args = (max_spec_tokens, max_spec_factor, min_token_prob, max_depth)
        own = self.local[request_id].speculate(context, *args)
        shared = self.shared.speculate(context, *args, exclude=request_id) if len(self.shared) else NO_PROPOSAL
        return shared if shared.score > own.score else own
