from array import array

import pytest

from cache import CacheConfig, CacheManager, block_hashes
from tests.support.cache_cases import BS, make, prefill, run

def test_block_aligned_fully_cached_prompt_still_computes_its_last_block():
    m = make()
    run(m, "a", list(range(8)))
    adm = m.admit("b", list(range(8)))
    assert adm.num_cached_tokens == 4 and adm.kv_matched_tokens == 4 and adm.restore_row is not None
    m.free("b", list(range(8)), 4)
    run(m, "c", list(range(9)))
    assert m.admit("d", list(range(9))).num_cached_tokens == 8  # state after exactly 8 tokens, 1 token computed


def test_prompt_end_snapshot_sits_at_the_last_boundary_before_the_last_token():
    m = make()
    assert m.admit("a", list(range(10))).num_cached_tokens == 0
    assert m.capture_positions("a") == [8]
    m.free("a", list(range(10)), 0)
    m.admit("b", list(range(12)))
    assert m.capture_positions("b") == [8, 12]


def test_long_prompts_get_sparse_checkpoints():
    m = CacheManager(CacheConfig(block_size=BS, num_blocks=64, num_live_slots=2, num_snapshot_slots=8,
                                 checkpoint_interval=18))  # floored to 16
    m.admit("a", list(range(50)))
    assert m.capture_positions("a") == [16, 32, 48]
    run(m, "b", list(range(100, 150)))
    adm = m.admit("c", list(range(100, 140)) + [7] * 10)   # diverges at 40, before any branch snapshot exists
    assert adm.num_cached_tokens == 32 and adm.kv_matched_tokens == 40 and 40 in m.capture_positions("c")


def test_turn_starts_get_snapshots_so_a_replaced_final_message_reuses_the_conversation():
    """Qwen Code's side request resends the conversation with its own final message; the next turn's request keeps
    the conversation, adds turns and ends with that message again. Without a snapshot at the start of the final
    message, the second request matched the KV of the whole conversation but had no state to resume from."""
    IM = 1000
    conversation = [IM] + list(range(1, 30)) + [IM] + list(range(30, 41))      # turns start at 0 and 30
    final = [IM] + list(range(500, 520))                                       # starts at 41
    first = conversation + final
    m = make(checkpoint_interval=0)
    m.admit("a", first, turn_starts=(30, 41))
    assert m.capture_positions("a") == [28, 40, 60]      # 28, 40: boundaries at or before the two turn starts
    m.free("a", first, 0)
    m = make(checkpoint_interval=0)
    adm = m.admit("a", first, turn_starts=(30, 41))
    for p in m.capture_positions("a"):
        m.reserve_capture("a", p)
        m.commit("a", first, p)
    m.commit("a", first, len(first))
    m.free("a", first, len(first))
    second = conversation + [IM, 7, 8, 9, IM, 11, 12] + final
    adm = m.admit("b", second, turn_starts=(48, 52))
    assert adm.kv_matched_tokens == 40 and adm.num_cached_tokens == 40
    m.free("b", second, 40)
    m = make(checkpoint_interval=0)                       # the same without turn starts: nothing to resume from
    run(m, "a", first)
    adm = m.admit("b", second)
    assert adm.kv_matched_tokens == 40 and adm.num_cached_tokens == 0


def test_multi_turn_continues_from_the_finished_sequence_state():
    m = make()
    _, history = run(m, "t1", list(range(10)), output=[50, 51, 52, 53, 54, 55, 56])
    assert len(history) == 17  # 16 computed: decode boundaries 12 and 16 captured into one tracking row
    adm, _ = run(m, "t2", history + [60, 61, 62])
    assert adm.num_cached_tokens == 16 and m.stats.snapshots_restored == 1


def test_decode_tracking_row_is_reserved_without_moving_its_position():
    """A multi-step call gets the tracking row before it knows which boundary the row reaches: the row the last
    boundary went to, with that boundary still recorded, until decode_capture_row records a deeper one."""
    m = make()
    prompt = list(range(10))
    prefill(m, "a", prompt)
    tokens = prompt + [50, 51, 52]
    assert m.append_slots("a", 12)
    row = m.decode_capture_row("a", 12)                  # boundary 12 reached by a single step
    m.commit("a", tokens, 12)
    assert m.decode_tracking_row("a") == row             # same row, position still 12
    tokens += [53, 54, 55]                               # the call ran tokens 12..14 and stopped before 16
    assert m.append_slots("a", 16)
    m.commit("a", tokens, 15)
    m.free("a", tokens, 15)
    adm = m.admit("b", tokens + [60, 61])
    assert adm.num_cached_tokens == 12 and adm.restore_row is not None

    m2 = make()                                          # reserved but never recorded: freed, nothing registered
    prefill(m2, "a", prompt)
    assert m2.decode_tracking_row("a") is not None
    captured = m2.stats.snapshots_captured
    m2.free("a", prompt + [50], 10)
    assert m2.stats.snapshots_captured == captured and m2.snapshots.num_reserved == 0


def test_branch_point_is_captured_so_siblings_hit():
    m = make()
    system = list(range(100, 108))  # two blocks shared by everyone
    run(m, "a", system + [1, 2, 3, 4, 5])
    adm_b, _ = run(m, "b", system + [7, 7, 7])
    assert adm_b.num_cached_tokens == 0 and adm_b.kv_matched_tokens == 8
    assert m.stats.lost_to_missing_state_tokens == 8
    adm_c = m.admit("c", system + [9, 9, 9, 9, 9])
    assert adm_c.num_cached_tokens == 8 and 8 not in m.capture_positions("c")


def test_partial_kv_eviction_keeps_shallower_snapshots_usable():
    m = make(num_blocks=20)
    system = list(range(100, 108))
    run(m, "a", system + [1] * 9)            # snapshot at 16
    run(m, "b", system + [2] * 5)            # branch point: snapshots at 8 and 12
    assert m.stats.snapshots_captured == 3
    m.evict_cached_blocks(2)                 # a's older chain, tail first: blocks ending at 16 and 12
    assert m.stats.snapshots_invalidated == 1
    adm = m.admit("c", system + [1] * 9)
    assert adm.num_cached_tokens == 8 and adm.restore_row is not None


@pytest.mark.parametrize("path", ["admit", "append", "evict", "evict_until_free", "clear", "insert_excess"])
def test_every_eviction_and_clear_path_invalidates_snapshots(path, monkeypatch):
    m = make(num_blocks=7, live=2)          # 6 usable blocks
    run(m, "a", list(range(17)))             # 5 blocks cached, snapshot at 16 tied to block 4
    calls = []
    original = m.registry.handle_mamba_prefix_evicted_blocks
    monkeypatch.setattr(m.registry, "handle_mamba_prefix_evicted_blocks",
                        lambda ids: calls.append(list(ids)) or original(ids))
    if path == "admit":
        assert m.admit("b", list(range(200, 217))) is not None
    elif path == "append":
        m.admit("b", [1])
        assert m.append_slots("b", 12)
    elif path == "evict":
        m.evict_cached_blocks(1)
    elif path == "evict_until_free":
        m.evict_until_free(3)
    elif path == "clear":
        m.clear_prefix_cache()
    else:
        m.blocks.max_cached_blocks = 4
        m.admit("b", list(range(300, 305)))
        m.commit("b", list(range(300, 305)), 5)
    assert calls and m.stats.snapshots_invalidated == 1 and not m.registry.valid_mamba_prefix_hashes
    assert m.stats.kv_blocks_evicted == sum(map(len, calls))


def test_restore_snapshot_is_pinned_until_the_first_commit():
    m = make(snaps=1)
    run(m, "a", list(range(9)))
    adm = m.admit("b", list(range(9)))
    assert adm.restore_row is not None
    m.admit("c", list(range(50, 59)))
    assert m.reserve_capture("c", 8) is None  # the only row is pinned by b's pending restore
    m.clear_prefix_cache()                     # invalidated while pinned: row comes back at b's commit
    assert m.snapshots.num_free == 0
    m.commit("b", list(range(9)), 9)
    assert m.snapshots.num_free == 1 and m.reserve_capture("c", 8) is not None


def test_snapshot_pool_lru_frees_only_the_snapshot_not_the_kv():
    m = make(snaps=1)
    run(m, "a", list(range(9)))
    run(m, "b", list(range(50, 59)))
    assert m.stats.snapshots_evicted == 1 and m.blocks.num_cached == 4
    adm = m.admit("c", list(range(9)))
    assert adm.kv_matched_tokens == 8 and adm.num_cached_tokens == 0  # KV kept, state gone: recompute


def test_slots_and_blocks_are_bounded_and_come_back():
    m = make(num_blocks=6, live=2)
    assert m.admit("a", [1] * 5) and m.admit("b", [2] * 5)
    assert m.admit("c", [3]) is None and m.stats.admission_failures == 1
    m.free("a", [1] * 5, 5)
    assert m.admit("c", [3] * 13) is None   # 4 blocks needed, 3 obtainable
    assert not m.append_slots("b", 21)
    m.free("b", [2] * 5, 5)
    assert m.num_free_slots == 2 and m.blocks.num_used == 0
    assert m.stats.peak_slots_in_use == 2 and m.stats.peak_blocks_in_use == 4


def test_plain_transformer_reuses_the_kv_match_without_snapshots():
    m = make(hybrid=False)
    run(m, "a", list(range(9)))
    adm = m.admit("b", list(range(10)))
    assert adm.num_cached_tokens == 8 and adm.restore_row is None and m.capture_positions("b") == []


def test_prefix_caching_off_reuses_nothing():
    m = make(enable_prefix_caching=False)
    run(m, "a", list(range(9)))
    assert m.admit("b", list(range(9))).num_cached_tokens == 0 and m.blocks.num_cached == 0


def test_captures_are_published_only_after_their_step_commits():
    m = make()
    m.admit("a", list(range(9)))
    m.reserve_capture("a", 8)
    m.commit("a", list(range(9)), 4)
    assert not m.registry.valid_mamba_prefix_hashes and m.blocks.num_cached == 1
    m.free("a", list(range(9)), 4)  # aborted before the capture ran: row released
    assert m.snapshots.num_free == 8


def test_bad_calls_say_what_is_wrong():
    m = make()
    m.admit("a", list(range(9)))
    with pytest.raises(ValueError, match="already admitted"):
        m.admit("a", [1])
    with pytest.raises(ValueError, match="multiple of 4"):
        m.reserve_capture("a", 6)
    with pytest.raises(ValueError, match="empty prompt"):
        m.admit("z", [])
    with pytest.raises(KeyError):
        m.block_table("nope")


def test_a_shared_prefix_state_survives_churn_of_one_off_snapshots():
    m = make(snaps=4)
    system = list(range(100, 108))
    run(m, "a", system + [1] * 5)
    run(m, "b", system + [2] * 5)            # branch point 8 captured
    for i in range(6):                       # each hits 8 and leaves one-off snapshots behind
        adm, _ = run(m, f"q{i}", system + [10 + i] * 5, output=[7] * 6)
        assert adm.num_cached_tokens == 8
    assert m.stats.snapshots_evicted > 0


def test_a_finished_turn_supersedes_its_prompt_end_and_restored_snapshots():
    m = make(snaps=8)
    _, h1 = run(m, "t1", list(range(10)), output=[50] * 7)     # prompt end 8, finish 16
    _, h2 = run(m, "t2", h1 + [60, 61, 62], output=[70] * 6)   # restores 16 (its only hit); prompt end 20, finish 24
    at = {p: block_hashes(h2, BS)[p // BS - 1] for p in (8, 16, 20, 24)}
    assert list(m.snapshots._lru[0]) == [at[16], at[20], at[8]]  # eviction order
    assert list(m.snapshots._lru[1]) == [at[24]]                # it continued t1's end: protected


def test_kv_tail_ending_a_snapshot_outlives_a_newer_tail_without_one():
    m = make(num_blocks=12)
    run(m, "a", list(range(9)))              # snapshot at 8, tied to a's block 2
    b = list(range(50, 59))
    m.admit("b", b)
    m.commit("b", b, 9)                      # published without any capture
    m.free("b", b, 9)
    m.evict_cached_blocks(2)                 # b's chain goes first although it is newer
    assert m.admit("c", list(range(9))).num_cached_tokens == 8


def test_kv_tail_ending_a_protected_snapshot_outlives_a_newer_tail_ending_a_probation_one():
    """A snapshot that was hit sits in the protected segment, and its KV tail outlives the tails of snapshots nobody
    has used yet, however recent: the KV is worth what its snapshot saves."""
    m = make(num_blocks=12)
    run(m, "a", list(range(9)))              # snapshot at 8, tied to a's block 2
    assert run(m, "a again", list(range(9)))[0].num_cached_tokens == 8      # a hit: protected
    run(m, "b", list(range(50, 59)))         # newer, snapshot at 8 on probation
    m.evict_cached_blocks(2)                 # b's chain goes first
    assert m.admit("c", list(range(9))).num_cached_tokens == 8
    assert m.admit("d", list(range(50, 59))).num_cached_tokens == 0


def test_an_admission_released_before_any_step_is_not_counted():
    m = make()
    run(m, "a", list(range(9)))
    before = m.stats.as_dict()
    m.admit("b", list(range(9)))
    m.free("b", list(range(9)), 8)  # the scheduler could not fit it after all
    assert m.stats.as_dict() == before
    adm, _ = run(m, "c", list(range(9)))
    assert m.stats.prompt_tokens == 18 and m.stats.reused_tokens == 8 and m.stats.snapshots_restored == 1


def test_a_failed_admission_or_append_changes_nothing():
    """Blocks an allocation cannot reach (cached under a running sequence's chain) are not counted as available,
    so a request that does not fit fails before evicting anything, however often the scheduler retries it."""
    m = make(num_blocks=13)                     # 12 usable blocks
    a = list(range(100, 113))
    m.admit("a", a)
    m.commit("a", a, 13)                        # a's 3 full blocks cached, no snapshot
    m.free("a", a, 13)
    s = a[:12] + [7] * 5
    adm = m.admit("s", s)
    assert adm.kv_matched_tokens == 12 and adm.num_cached_tokens == 0   # KV beyond the state: recomputed as twins
    m.commit("s", s, 17)                        # s publishes its 4th block under a's chain and keeps running
    run(m, "c", list(range(200, 209)))          # c's blocks cached with its snapshot at 8
    assert m.num_free_blocks == 4               # 2 free + c's 2; a's 3 blocks cannot be evicted while s runs
    before = (m.stats.kv_blocks_evicted, m.stats.snapshots_invalidated, m.blocks.num_cached)
    for _ in range(3):                          # the scheduler retries the waiting head every step
        assert m.admit("x", list(range(300, 320))) is None          # 5 blocks
        assert not m.append_slots("s", 17 + 5 * BS)
    assert (m.stats.kv_blocks_evicted, m.stats.snapshots_invalidated, m.blocks.num_cached) == before
    assert m.admit("c2", list(range(200, 209))).num_cached_tokens == 8
    m.free("c2", list(range(200, 209)), 0)
    assert m.admit("y", list(range(400, 416))) is not None              # exactly num_free_blocks: fits


def _parent_blind_hash(parent_hash, token_ids):
    return bytes(array("i", token_ids))         # equal blocks collide under any parent


def test_a_prefix_match_checks_the_chain_not_just_the_block():
    m = CacheManager(CacheConfig(block_size=BS, num_blocks=64, num_live_slots=4, num_snapshot_slots=8),
                     block_hash_fn=_parent_blind_hash)
    run(m, "a", [1, 1, 1, 1, 5, 5, 5, 5, 9])   # snapshot at 8 on block [5,5,5,5] under [1,1,1,1]
    run(m, "b", [2, 2, 2, 2, 9])
    c = [2, 2, 2, 2, 5, 5, 5, 5, 7]            # same block [5,5,5,5] under another parent
    adm = m.admit("c", c)
    assert adm.kv_matched_tokens == 4 and adm.num_cached_tokens == 4     # b's block and snapshot, not a's
    m.commit("c", c, 9)                        # c's own [5,5,5,5] cannot be published under the colliding hash
    m.free("c", c, 9)
    assert m.admit("d", c).kv_matched_tokens == 4
    assert m.admit("e", [1, 1, 1, 1, 5, 5, 5, 5, 3]).num_cached_tokens == 8   # a's chain is intact


def test_a_commit_costs_the_new_blocks_only(monkeypatch):
    """Two identical sequences decoding together: every block of the second is a twin of the first's."""
    m = make(num_blocks=256, snaps=0)
    prompt = list(range(9))
    m.admit("t", prompt)
    m.admit("s", prompt)
    lookups = []
    for name in ("cached_block", "cached_child"):
        original = getattr(m.blocks, name, None)
        if original is not None:
            monkeypatch.setattr(m.blocks, name, lambda *a, f=original: lookups.append(1) or f(*a))
    tokens = list(prompt)
    for n in range(9, 400):
        tokens.append(n % 5)
        for sid in ("t", "s"):
            assert m.append_slots(sid, n + 1)
            m.commit(sid, tokens, n + 1)
    assert len(lookups) <= 2 * 2 * 100          # ~100 blocks each, at most two lookups a block
    m.free("s", tokens, 400)
    m.free("t", tokens, 400)
    assert m.blocks.num_used == 0
