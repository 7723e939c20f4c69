from cache import SnapshotPool

H = [bytes([i]) * 16 for i in range(6)]


def test_lru_eviction_skips_pinned_and_reports():
    evicted = []
    pool = SnapshotPool(range(5, 8), on_evict=evicted.append)
    rows = [pool.reserve() for _ in range(3)]
    assert sorted(rows) == [5, 6, 7] and pool.reserve() is None  # all reserved: nothing evictable
    for h, r in zip(H, rows):
        pool.register(h, r)
    pool.touch(H[0])
    pool.pin(pool.row_of(H[1]))
    row = pool.reserve()  # H[1] is the LRU but pinned: H[2] goes
    assert evicted == [H[2]] and row == rows[2] and H[2] not in pool


def test_discarding_a_pinned_snapshot_frees_its_row_at_unpin():
    pool = SnapshotPool(range(1, 3))
    r = pool.reserve()
    pool.register(H[0], r)
    pool.pin(r)
    pool.pin(r)
    assert pool.discard(H[0]) and H[0] not in pool and pool.num_free == 1
    pool.unpin(r)
    assert pool.num_free == 1
    pool.unpin(r)
    assert pool.num_free == 2


def test_reregistering_a_hash_frees_the_old_row_and_demoted_go_first():
    evicted = []
    pool = SnapshotPool(range(1, 4), on_evict=evicted.append)
    a, b = pool.reserve(), pool.reserve()
    pool.register(H[0], a)
    pool.register(H[0], b)
    assert pool.row_of(H[0]) == b and pool.num_free == 2 and pool.num_registered == 1
    c = pool.reserve()
    pool.register(H[1], c)
    pool.demote(H[1])  # newest but demoted
    pool.register(H[2], pool.reserve())
    pool.reserve()
    assert evicted == [H[1]]


def test_segmented_lru_keeps_a_hit_snapshot_against_one_off_churn():
    evicted = []
    pool = SnapshotPool(range(1, 4), on_evict=evicted.append)
    pool.register(H[0], pool.reserve())
    pool.promote(H[0], max_protected=2)
    assert pool.hits(H[0]) == 1
    for h in H[1:5]:  # four one-off snapshots through a pool of three
        pool.register(h, pool.reserve())
    assert H[0] in pool and evicted == [H[1], H[2]]


def test_protected_segment_is_capped():
    pool = SnapshotPool(range(1, 4))
    for h in H[:3]:
        pool.register(h, pool.reserve())
        pool.promote(h, max_protected=2)
    pool.reserve()  # H[0] fell back to probation when H[2] was promoted: it goes first
    assert H[0] not in pool and H[1] in pool and H[2] in pool


def test_a_reservation_that_may_not_evict_protected_takes_probation_or_nothing():
    evicted = []
    pool = SnapshotPool(range(1, 3), on_evict=evicted.append)
    pool.register(H[0], pool.reserve(), origin="branch")
    pool.promote(H[0], max_protected=1)
    pool.register(H[1], pool.reserve())
    row = pool.reserve(may_evict_protected=False)
    assert evicted == [H[1]] and row is not None
    assert pool.reserve(may_evict_protected=False) is None and H[0] in pool and pool.origin(H[0]) == "branch"
    pool.release(row)
    pool.discard(H[0])
    assert pool.origin(H[0]) is None and pool.hits(H[0]) == 0
