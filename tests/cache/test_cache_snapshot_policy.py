"""Which snapshots the cache keeps under pressure: shared prefixes' states outlive one-off and superseded ones."""
import pytest

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


def test_a_prompt_waits_for_a_sibling_still_computing_their_shared_prefix():
    """The sibling captures where the prompts part, and the waiting prompt restores exactly there once the sibling
    published it; a prompt sharing too little, or only what the cache already serves, is not held."""
    doc = list(range(200, 360))                                  # 40 blocks both prompts share
    m = make(snaps=8)
    assert m.admit("a", doc + [1] * 9) is not None
    assert m.sibling_prefix(doc + [2] * 9) == ("a", 160)
    assert 160 in m.capture_positions("a")                        # a branch point nobody asked for yet
    assert m.sibling_prefix(list(range(200, 240)) + [3] * 9) is None     # 40 tokens < sibling_wait_tokens
    for p in [96, 160]:                                          # a prefills in two chunks
        if p in m.capture_positions("a"):
            m.reserve_capture("a", p)
        m.commit("a", doc + [1] * 9, p)
        assert (m.sibling_prefix(doc + [2] * 9) is None) == (p == 160)
    assert m.admit("b", doc + [2] * 9).num_cached_tokens == 160
    m.free("b", doc + [2] * 9, 0)
    m.free("a", doc + [1] * 9, 160)
    assert m.sibling_prefix(doc + [2] * 9) is None               # nobody admitted: nothing to wait for


@pytest.mark.parametrize("turn_one_state", ["kept", "lost"])
def test_a_conversation_that_came_back_keeps_its_end_through_one_off_churn(turn_one_state):
    """A finished turn that continued an earlier one (it restored that turn's end, or matched its KV after its state
    was evicted) starts protected; one-off requests' ends churn the probation segment without pushing it out."""
    m = make(snaps=4)
    _, turn1 = run(m, "a1", list(range(100, 110)), output=[7] * 6)
    if turn_one_state == "lost":
        while m.snapshots.evict_lru() is not None:
            pass
    adm, turn2 = run(m, "a2", turn1 + [8] * 5, output=[7] * 6)
    assert adm.num_cached_tokens == (12 if turn_one_state == "kept" else 0)
    for i in range(4):
        run(m, f"x{i}", list(range(500 + 20 * i, 510 + 20 * i)), output=[9] * 6)
    assert m.admit("a3", turn2 + [6] * 5).num_cached_tokens == (len(turn2) - 1) // 4 * 4


def test_ends_of_conversations_that_stopped_give_way_to_a_returning_one():
    """The protected segment is full of conversations that do not come back (a second pass over a trace leaves the
    first pass's ends there); a conversation that does come back still gets its end protected."""
    m = make(snaps=4)                                    # at most 3 protected
    for i in range(3):
        _, turn1 = run(m, f"c{i}", list(range(300 + 40 * i, 310 + 40 * i)), output=[7] * 6)
        run(m, f"c{i} again", turn1 + [8] * 5, output=[7] * 6)       # continued: its end protected
    _, turn1 = run(m, "a1", list(range(100, 110)), output=[7] * 6)
    for i in range(3):                                   # one-off churn evicts a1's end (its KV stays)
        run(m, f"x{i}", list(range(500 + 20 * i, 510 + 20 * i)), output=[9] * 6)
    adm, turn2 = run(m, "a2", turn1 + [8] * 5, output=[7] * 6)
    assert adm.num_cached_tokens == 0 and adm.kv_matched_tokens > 0          # came back, its state lost
    for i in range(3):
        run(m, f"y{i}", list(range(700 + 20 * i, 710 + 20 * i)), output=[9] * 6)
    assert m.admit("a3", turn2 + [6] * 5).num_cached_tokens == (len(turn2) - 1) // 4 * 4
