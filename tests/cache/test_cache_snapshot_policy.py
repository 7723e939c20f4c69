"""Which snapshots the cache keeps under pressure: shared prefixes' states outlive one-off and superseded ones."""
from tests.support.cache_cases import make, prefill, run

SYSTEM = list(range(100, 108))  # two blocks every request below shares


def test_a_shared_snapshot_is_not_demoted_when_its_first_user_finishes():
    m = make(snaps=4)
    run(m, "a", SYSTEM + [1] * 5)
    run(m, "b", SYSTEM + [2] * 5)                        # branch point 8 captured
    adm, _ = run(m, "c", SYSTEM + [3] * 5, output=[9] * 6)
    assert adm.num_cached_tokens == 8                    # c restored 8 (its first hit) and finished deeper
    run(m, "d", list(range(500, 509)))                   # one unrelated request takes a row
    assert m.admit("e", SYSTEM + [4] * 5).num_cached_tokens == 8


def test_decode_tracking_rows_do_not_evict_a_hot_snapshot():
    m = make(snaps=2)
    run(m, "a", SYSTEM + [1] * 5)
    run(m, "b", SYSTEM + [2] * 5)
    for i in range(6):
        adm, _ = run(m, f"q{i}", SYSTEM + [10 + i] * 5)
        assert adm.num_cached_tokens == 8                # hit six times: protected
    rows = []
    for i in range(2):                                   # as many decoders as rows (prompts too short to capture)
        prefill(m, f"d{i}", [600 + i] * 3)
        rows.append(m.decode_tracking_row(f"d{i}"))
    assert rows[0] is not None and rows[1] is None       # the second yields instead of evicting
    assert m.admit("e", SYSTEM + [4] * 5).num_cached_tokens == 8
