from hashlib import blake2b

import pytest

from cache import BlockPool, block_hashes, hash_block_tokens
from cache.hashing import HASH_BYTES

BS = 4


def fill(pool, tokens, hashes=None):
    """Allocate and publish the full blocks of `tokens` as one chain; returns the block ids."""
    hashes = hashes or block_hashes(tokens, BS)
    ids = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(ids, hashes)):
        pool.publish(b, h, ids[i - 1] if i else None, tokens[i * BS:(i + 1) * BS])
    return ids


def test_hash_chain_is_stable_and_prefix_local():
    toks = list(range(16))
    hs = block_hashes(toks, BS)
    assert hs == block_hashes(list(toks), BS) and len(hs) == 4
    expected = blake2b(digest_size=HASH_BYTES)
    expected.update((0).to_bytes(4, "little") + (1).to_bytes(4, "little") + (2).to_bytes(4, "little")
                    + (3).to_bytes(4, "little"))
    assert hs[0] == expected.digest()  # no process salt: the same on every run and host
    changed = toks[:9] + [999] + toks[10:]  # block 2 changes
    hc = block_hashes(changed, BS)
    assert hc[:2] == hs[:2] and all(a != b for a, b in zip(hc[2:], hs[2:]))
    assert block_hashes(toks[:15], BS) == hs[:3]  # a partial tail block has no hash
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(hs[0], [1, 2])


def test_match_stops_at_first_missing_block_and_never_matches_a_partial_tail():
    pool = BlockPool(16)
    toks = list(range(12))
    ids = fill(pool, toks)
    pool.release(ids)
    query = toks[:8] + [99, 99, 99, 99] + [5, 5]
    assert pool.match(block_hashes(query, BS), query, BS) == ids[:2]
    assert pool.match(block_hashes(toks[:11], BS), toks[:11], BS) == ids[:2]


def test_hash_hit_with_different_tokens_is_not_served():
    pool = BlockPool(8)
    forged = block_hashes([1, 2, 3, 4], BS)
    fill(pool, [9, 9, 9, 9], forged)  # pretend [9,9,9,9] collided with [1,2,3,4]
    assert pool.match(forged, [1, 2, 3, 4], BS) == []


def test_a_hash_hit_under_another_parent_is_not_served():
    pool = BlockPool(8)
    a = fill(pool, [1, 1, 1, 1, 5, 5, 5, 5], [b"a", b"five"])
    b = fill(pool, [2, 2, 2, 2], [b"b"])
    assert pool.match([b"b", b"five"], [2, 2, 2, 2, 5, 5, 5, 5], BS) == b     # equal tokens, wrong parent
    assert pool.match([b"a", b"five"], [1, 1, 1, 1, 5, 5, 5, 5], BS) == a


def test_freed_block_stays_matchable_until_reused():
    evicted = []
    pool = BlockPool(4, on_evict=evicted.extend)  # 3 usable blocks
    toks = list(range(8))
    ids = fill(pool, toks)
    pool.release(ids)
    assert pool.num_free == 1 and pool.num_available == 3
    assert pool.match(block_hashes(toks, BS), toks, BS) == ids
    fresh = pool.allocate(1)  # the free one, no eviction
    assert evicted == [] and fresh[0] not in ids
    pool.allocate(1)  # now the LRU leaf (tail of the chain) is reused
    assert evicted == [ids[1]]
    assert pool.match(block_hashes(toks, BS), toks, BS) == ids[:1]


def test_leaf_lru_eats_the_oldest_chain_tail_first_and_touch_protects():
    evicted = []
    pool = BlockPool(16, on_evict=evicted.extend)
    a = fill(pool, list(range(12)))
    b = fill(pool, list(range(100, 112)))
    pool.release(a)
    pool.release(b)
    pool.acquire(a)  # a match on all of a refreshes the chain
    pool.release(a)
    assert pool.evict(2) == [b[2], b[1]]  # b is older now: its tail first, never a parent before its child
    pool.acquire(a[:1])  # a shorter match refreshes only a's first block: a's tail is older than it
    pool.release(a[:1])
    assert pool.evict(10) == [b[0], a[2], a[1], a[0]]
    assert evicted == [b[2], b[1], b[0], a[2], a[1], a[0]] and pool.num_cached == 0


def test_referenced_blocks_are_never_evicted_and_a_failed_allocation_evicts_nothing():
    evicted = []
    pool = BlockPool(8, on_evict=evicted.extend)  # 7 usable
    held = fill(pool, list(range(8)))
    cached = fill(pool, list(range(100, 108)))
    pool.release(cached)
    assert pool.num_available == 5 and pool.can_allocate(5) and not pool.can_allocate(5, shared=cached[:1])
    assert pool.allocate(6) is None and evicted == [] and pool.num_cached == 4
    assert pool.evict(5) == [cached[1], cached[0]] and pool.ref_count(held[1]) == 1


def test_a_block_is_published_only_under_a_cached_and_referenced_parent():
    pool = BlockPool(8)
    [parent] = fill(pool, list(range(4)))
    [child] = pool.allocate(1)
    h = block_hashes(list(range(8)), BS)[1]
    pool.release([parent])  # cached, unreferenced: a child under it would pin it beyond num_available's count
    with pytest.raises(ValueError, match="cached and referenced"):
        pool.publish(child, h, parent, range(4, 8))
    pool.acquire([parent])
    assert pool.publish(child, h, parent, range(4, 8)) and pool.parent_of(child) == parent


def test_ref_counts_and_duplicate_publish():
    pool = BlockPool(8)
    toks = list(range(4))
    [b] = fill(pool, toks)
    pool.acquire([b])  # a second sequence shares it
    assert pool.ref_count(b) == 2
    [twin] = pool.allocate(1)
    assert pool.publish(twin, block_hashes(toks, BS)[0], None, toks) is False  # already cached: stays private
    pool.release([twin])
    assert pool.is_free(twin) and pool.cached_block(block_hashes(toks, BS)[0]) == b
    pool.release([b])
    assert pool.ref_count(b) == 1 and pool.evict(1) == []
    pool.release([b])
    assert pool.evict(1) == [b] and pool.is_free(b)
    with pytest.raises(ValueError):
        pool.release([b])


@pytest.mark.parametrize("path", ["allocate", "evict", "evict_until_free", "clear", "insert_excess"])
def test_every_eviction_path_reports_the_evicted_blocks(path):
    reports = []
    pool = BlockPool(5, on_evict=reports.append, max_cached_blocks=3 if path == "insert_excess" else None)
    toks = list(range(12))
    ids = fill(pool, toks)
    if path == "insert_excess":
        pool.release(ids[:2])
        pool.release(ids[2:])  # leaf ids[2] is the LRU leaf
        [b] = pool.allocate(1)
        pool.publish(b, block_hashes(list(range(50, 54)), BS)[0], None, range(50, 54))
        assert reports == [[ids[2]]]
        return
    pool.release(ids)
    if path == "allocate":
        pool.allocate(2)
    elif path == "evict":
        pool.evict(1)
    elif path == "evict_until_free":
        pool.evict_until_free(2)
    else:
        pool.clear_prefix_cache()
    expected = {"allocate": [[ids[2]]], "evict": [[ids[2]]], "evict_until_free": [[ids[2]]],
                "clear": [ids]}[path]
    assert [sorted(r) for r in reports] == [sorted(r) for r in expected]


def test_block_zero_is_never_handed_out():
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert sorted(got) == [1, 2, 3] and pool.allocate(1) is None


def test_protected_leaves_go_after_every_unprotected_leaf():
    pool = BlockPool(16)
    a = fill(pool, list(range(8)))
    b = fill(pool, list(range(100, 108)))
    pool.release(a)
    pool.release(b)
    pool.set_protected(a[1], True)  # a's tail ends a snapshot; a is the older chain
    assert pool.evict(2) == [b[1], b[0]]
    assert pool.evict(1) == [a[1]]  # only protected left: LRU among them; then its parent
    assert pool.evict(1) == [a[0]]
