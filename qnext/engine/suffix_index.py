"""Suffix and n-gram drafting's data structure (docs/speculative.md, "Suffix and n-gram drafting"): token sequences
with an index of where each short n-gram ends, and the query that proposes the tokens likely to follow a context.

A suffix tree of depth D over the sequences holds, at the node of a pattern, how often each token followed it. The
same counts come from an index of occurrences: the positions p where the context's last L tokens end (the index's
key), each extended backwards to its match length m (up to D tokens of the context agree before p + 1). The
occurrences matching at least m tokens are the tree node of the context's last m tokens; walking forward, the
share of them that continue with the most frequent next token is that child's count over its parent's (Arctic
Inference's suffix decoding: the path's probability is the product of these shares). The index costs a list entry
per token per key length instead of D tree nodes per token, and a query reads at most MAX_CANDIDATES occurrences
(the most recent) per key length.

SuffixIndex holds sequences by key (a request id); `speculate` proposes. SuffixCache (suffix_cache.py) bounds
the memory of other requests' outputs with an LRU.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

MAX_CANDIDATES = 64        # occurrences a query reads per key length (the most recent)
MAX_MATCH_LENGTHS = 4      # distinct match lengths scored per key length (the longest)


@dataclasses.dataclass
class Proposal:
    tokens: list[int]
    score: float           # expected accepted tokens: the sum of the path's probabilities
    match_length: int      # context tokens the proposal's occurrences matched


NO_PROPOSAL = Proposal([], 0.0, 0)


class SuffixIndex:
    """Sequences (key -> token list) with, for each key length L, where every L-gram ends."""

    def __init__(self, key_lengths: tuple[int, ...] = (2, 4, 8)):
        if not key_lengths or any(not isinstance(n, int) or n < 1 for n in key_lengths):
            raise ValueError(f"key_lengths must be positive integers, got {key_lengths!r}")
        self.key_lengths = tuple(sorted(set(key_lengths)))
        self.sequences: dict[object, list[int]] = {}
        self._ends: dict[int, dict[tuple, list[tuple[object, int]]]] = {n: {} for n in self.key_lengths}
        self.num_tokens = 0

    def __contains__(self, key) -> bool:
        return key in self.sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def extend(self, key, tokens) -> None:
        """Appends tokens to the sequence `key` (created empty if new), indexing every n-gram they complete."""
        seq = self.sequences.setdefault(key, [])
        for t in tokens:
            seq.append(int(t))
            p = len(seq) - 1
            for n in self.key_lengths:
                if p + 1 >= n:
                    self._ends[n].setdefault(tuple(seq[p + 1 - n:]), []).append((key, p))
        self.num_tokens += len(tokens)

    def remove(self, key) -> None:
        """Drops the sequence `key` and its index entries (nothing if absent)."""
        seq = self.sequences.pop(key, None)
        if seq is None:
            return
        self.num_tokens -= len(seq)
        for n, ends in self._ends.items():
            for gram in {tuple(seq[p + 1 - n:p + 1]) for p in range(n - 1, len(seq))}:
                kept = [e for e in ends[gram] if e[0] != key]
                if kept:
                    ends[gram] = kept
                else:
                    del ends[gram]

    def occurrences(self, context: list[int], min_match: int, max_match: int, exclude=None):
        """[(sequence, p, m)]: positions p whose sequence's tokens ending at p equal the context's last m tokens,
        min_match <= m <= max_match (the longest such m), with at least one token after p; from the longest key
        length <= max_match whose key the context ends with and that has occurrences, most recent last. `exclude`:
        a key whose sequence is left out."""
        for n in reversed(self.key_lengths):
            if n > max_match or n > len(context) or max(n, min_match) > max_match:
                continue
            entries = self._ends[n].get(tuple(context[len(context) - n:]))
            if not entries:
                continue
            found = []
            for key, p in entries[-MAX_CANDIDATES:]:
                seq = self.sequences[key]
                if key == exclude or p + 1 >= len(seq):
                    continue
                m = n
                limit = min(max_match, p + 1, len(context))
                while m < limit and seq[p - m] == context[len(context) - 1 - m]:
                    m += 1
                if m >= min_match:
                    found.append((seq, p, m))
            if found:
                return found
        return []

    def speculate(self, context: list[int], max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
                  max_depth: int, exclude=None) -> Proposal:
        """Suffix decoding's proposal: for each of the longest match lengths m among the occurrences, the tokens
        along the most frequent continuation of the occurrences matching >= m tokens, at most
        min(max_spec_tokens, m * max_spec_factor), while the path's probability (product of each step's share)
        stays >= min_token_prob; the one with the highest score (sum of the path's probabilities)."""
        found = self.occurrences(context, 1, max_depth, exclude)
        best = NO_PROPOSAL
        for m in sorted({m for _, _, m in found}, reverse=True)[:MAX_MATCH_LENGTHS]:
            limit = min(max_spec_tokens, int(m * max_spec_factor))
            live = [(seq, p) for seq, p, mm in found if mm >= m]
            proposal = _walk(live, limit, min_token_prob, m)
            if proposal.score > best.score:
                best = proposal
        return best

    def lookup(self, context: list[int], num_tokens: int, min_match: int, max_match: int) -> list[int]:
        """vLLM's n-gram drafting (prompt lookup): the tokens after the most recent earlier occurrence of the
        context's longest suffix of min_match..max_match tokens, up to num_tokens of them ([] if none)."""
        found = self.occurrences(context, min_match, max_match)
        if not found:
            return []
        longest = max(m for _, _, m in found)
        seq, p, _ = [f for f in found if f[2] == longest][-1]
        return seq[p + 1:p + 1 + num_tokens]


def _walk(live: list[tuple[list[int], int]], limit: int, min_token_prob: float, match_length: int) -> Proposal:
    """The most frequent path forward from occurrences (sequence, p): at step j the token most of the live
    occurrences hold at p + 1 + j (ties: the most recent occurrence's), kept while the running product of shares
    is >= min_token_prob."""
    tokens, prob, score = [], 1.0, 0.0
    for j in range(limit):
        nexts = [(seq[p + 1 + j], seq, p) for seq, p in live if p + 1 + j < len(seq)]
        if not nexts:
            break
        counts = Counter(t for t, _, _ in reversed(nexts))          # insertion order: the most recent first
        token, count = counts.most_common(1)[0]
        prob *= count / len(live)
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        live = [(seq, p) for t, seq, p in nexts if t == token]
    return Proposal(tokens, score, match_length)
