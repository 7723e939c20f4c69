"""Suffix and n-gram drafting's data structures (qnext/engine/suffix_index.py, suffix_cache.py): proposals follow
the most frequent continuation with its confidence, stop below min_token_prob and at the match length's share,
n-gram lookup takes the longest match's most recent continuation, removal leaves no entry behind, and the shared
index is bounded by requests and tokens with the least recently updated request evicted first."""
from __future__ import annotations

import pytest

from qnext.engine.suffix_cache import SuffixCache
from qnext.engine.suffix_index import SuffixIndex


def spec(index, context, max_spec_tokens=8, factor=4.0, min_prob=0.1, depth=16, exclude=None):
    return index.speculate(context, max_spec_tokens, factor, min_prob, depth, exclude)


def test_proposes_the_most_frequent_continuation_with_its_probability():
    index = SuffixIndex()
    index.extend("a", [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 9])
    p = spec(index, [7, 1, 2, 3, 4])
    # 3 occurrences of [.., 3, 4]: 5 follows twice, 6 once -> 5 with probability 2/3, then 9 (both follow 5)
    # (the 2 occurrences left then run 9 1 2 3 4 together at 2/3, and part at 6 / 5: 1 each, the most recent's 6)
    assert p.tokens == [5, 9, 1, 2, 3, 4, 6, 9]
    assert p.score == pytest.approx(6 * 2 / 3 + 2 * 1 / 3)
    # min_token_prob above 2/3: nothing is confident enough
    assert spec(index, [7, 1, 2, 3, 4], min_prob=0.7).tokens == []


def test_longer_matches_decide_and_spec_factor_bounds_the_length():
    index = SuffixIndex()
    index.extend("a", [8, 3, 4, 5, 5, 5, 5, 5, 5, 9, 3, 4, 6, 6, 6, 6, 6, 6])
    # the context ends with 9 3 4: only the second occurrence matches 3 tokens, and it continues with 6s
    assert spec(index, [9, 3, 4]).tokens[:3] == [6, 6, 6]
    # max_spec_factor 1: at most as many tokens as matched (3)
    assert len(spec(index, [9, 3, 4], factor=1.0).tokens) <= 3
    assert spec(index, [1, 2]).tokens == []                     # no occurrence


def test_own_position_is_never_a_candidate_and_exclude_skips_a_sequence():
    index = SuffixIndex()
    index.extend("a", [1, 2, 3])
    assert spec(index, [1, 2, 3]).tokens == []                  # the only occurrence has nothing after it
    index.extend("b", [1, 2, 3, 7, 7])
    assert spec(index, [1, 2, 3]).tokens == [7, 7]
    assert spec(index, [1, 2, 3], exclude="b").tokens == []


def test_ngram_lookup_takes_the_longest_then_the_most_recent_match():
    index = SuffixIndex(key_lengths=(2,))
    seq = [5, 1, 2, 10, 11, 6, 1, 2, 20, 21, 5, 1, 2]
    index.extend("r", seq)
    # 5 1 2 matches 3 tokens at the first occurrence, 1 2 only 2 at the second
    assert index.lookup(seq, 2, min_match=2, max_match=4) == [10, 11]
    assert index.lookup(seq, 2, min_match=4, max_match=4) == []
    assert index.lookup(seq, 2, min_match=2, max_match=2) == [20, 21]     # both match 2: the most recent


def test_remove_drops_every_entry():
    index = SuffixIndex()
    index.extend("a", [1, 2, 3, 1, 2, 3])
    index.extend("b", [1, 2, 4])
    index.remove("a")
    assert index.num_tokens == 3 and "a" not in index
    assert all(key == "b" for ends in index._ends.values() for entries in ends.values() for key, _ in entries)
    assert spec(index, [1, 2]).tokens == [4]


def test_shared_index_is_bounded_and_evicts_the_least_recent_request():
    cache = SuffixCache(max_cached_requests=2, max_cached_tokens=10)
    cache.update("x", [0], [1, 2, 3])
    cache.update("y", [0], [4, 5, 6])
    cache.update("x", [0], [1, 2, 3, 7])          # x is now the most recent
    cache.update("z", [0], [8, 9])                # 3 requests > 2: y, the least recent, goes
    assert set(cache._recent) == {"x", "z"} and "y" not in cache.shared
    cache.update("w", [0], [1] * 9)               # 9 tokens: the bound of 10 evicts x, then z
    assert list(cache._recent) == ["w"] and cache.shared.num_tokens == 9
    cache.free("w")
    assert "w" not in cache.local and "w" in cache.shared        # its output stays for others


def test_other_requests_outputs_propose_and_a_request_is_not_its_own_shared_match():
    cache = SuffixCache(max_cached_requests=4)
    cache.update("done", [9, 9], [30, 31, 32, 33, 34])
    cache.free("done")
    cache.update("new", [1, 30, 31], [])
    assert cache.speculate("new", 4, 2.0, 0.1, 16).tokens == [32, 33, 34]
    # no shared cache: nothing to go on
    alone = SuffixCache(max_cached_requests=0)
    alone.update("done", [9], [30, 31, 32])
    alone.update("new", [1, 30, 31], [])
    assert alone.speculate("new", 4, 2.0, 0.1, 16).tokens == []


def test_update_restarts_when_the_output_is_not_a_continuation():
    cache = SuffixCache(max_cached_requests=0)
    cache.update("r", [1, 2], [3, 4])
    assert cache.update("r", [1, 2], [5]) == [1, 2, 5]
