"""The host tier's bookkeeping (cache/tiers.py): evictions offloaded, matches loaded back, the copies in order, and the
single-tier invariant extended to two tiers. Plain Python, milliseconds."""
import random

from cache import CacheConfig, CacheManager, block_hashes
from cache.replay import WORKLOADS, ReplaySettings
from cache.replay.tiers import host_tier_sweep, restart_replay
from cache.tiers import host_terminal
from cache.transfers import TransferQueue
from tests.support.cache_cases import BS, run


def make(num_blocks=7, live=2, snaps=2, host_blocks=16, host_snaps=4):
    return CacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks, num_live_slots=live,
                                    num_snapshot_slots=snaps, num_host_blocks=host_blocks,
                                    num_host_snapshot_slots=host_snaps))


def test_queue_runs_saves_before_loads_and_starts_a_phase_where_that_order_would_be_wrong():
    q = TransferQueue()
    q.save_block(3, 0)         # evict block 3 to slot 0 ...
    q.load_block(0, 5)         # ... and load it back into block 5: saves first is right
    q.load_block(1, 3)         # block 3 reused for a load
    q.save_block(4, 2)
    plan = q.take()
    assert len(plan.phases) == 1
    assert plan.phases[0].kv_saves == {0: 3, 2: 4} and plan.phases[0].kv_loads == {5: 0, 3: 1}
    q.load_block(1, 3)
    q.save_block(3, 7)         # block 3 loaded, then evicted again: the save must see the loaded data
    q.load_row(2, 1)
    q.save_row(6, 2)           # slot 2 is read by a load, then reused: the load must read first
    first, second, third = q.take().phases
    assert first.kv_loads == {3: 1} and second.kv_saves == {7: 3}
    assert second.state_loads == {1: 2} and third.state_saves == {2: 6} and not q.take()


def test_evicted_blocks_go_to_the_host_tier_and_a_match_loads_them_back():
    m = make()                                       # 6 usable blocks
    prompt = list(range(17))
    run(m, "a", prompt)                              # 4 full blocks cached, snapshot at 16
    assert not m.take_transfers()
    run(m, "b", list(range(100, 117)))               # needs 5 blocks: a's chain goes to the host tier, tail first
    saved = m.take_transfers().phases[0].kv_saves
    assert m.stats.tiers.blocks_offloaded == len(saved) == 3 and m.stats.snapshots_invalidated == 0
    adm = m.admit("c", prompt)
    assert adm.num_cached_tokens == 16 and adm.kv_matched_tokens == 16 and adm.restore_row is not None
    plan = m.take_transfers()
    loads = plan.phases[-1].kv_loads
    assert sorted(loads) == sorted(adm.block_table[1:4])           # block 0 stayed on the device
    assert sorted(loads.values()) == sorted(saved)                   # from the slots a's blocks went to
    t = m.stats.tiers
    assert (t.blocks_loaded, t.host_hit_tokens, t.device_hit_tokens, t.host_hits) == (3, 12, 4, 1)
    assert m.stats.reused_tokens == 16


def test_a_host_snapshot_is_restored_into_the_live_row_then_moves_back_into_the_pool_on_its_second_hit():
    m = make(num_blocks=64, snaps=1)
    run(m, "a", list(range(17)))                     # snapshot at 16 in the only row
    run(m, "b", list(range(100, 117)))               # its snapshot evicts a's: offloaded
    saves = m.take_transfers().phases[0].state_saves
    assert m.stats.snapshots_evicted == 1 and m.stats.tiers.snapshots_offloaded == 1 and len(saves) == 1
    slot = next(iter(saves))
    adm = run(m, "c", list(range(17)))[0]            # first hit: into c's live row; b's keeps the pool row
    assert adm.num_cached_tokens == 16 and adm.restore_row == adm.state_row
    assert m.take_transfers().phases[0].state_loads == {adm.state_row: slot}
    adm = m.admit("d", list(range(17)))              # second hit: back into the row, b's goes to the host tier
    assert adm.num_cached_tokens == 16 and adm.restore_row == m.snapshots.rows[0]
    assert m.state_rows("d") == (adm.restore_row, adm.state_row)
    phase = m.take_transfers().phases[0]
    assert phase.state_loads == {adm.restore_row: slot}    # after the row was saved (b's state)
    assert list(phase.state_saves.values()) == [adm.restore_row]
    t = m.stats.tiers
    assert len(m.tier.snapshots) == 1 and t.snapshots_loaded == 2 and t.host_hits == 2
    assert m.snapshots.hits(block_hashes(list(range(17)), BS)[3]) == 2


def test_without_a_free_snapshot_row_a_host_snapshot_stays_in_the_host_tier():
    m = make(num_blocks=64, snaps=1)
    run(m, "a", list(range(17)))
    run(m, "b", list(range(100, 117)))               # a's snapshot is in the host tier, b's in the only row
    run(m, "c", list(range(17)))                     # a's first hit: it may come back on the next
    assert m.admit("b2", list(range(100, 117))).restore_row == m.snapshots.rows[0]   # pinned until its first step
    m.take_transfers()
    adm = m.admit("d", list(range(17)))
    assert adm.num_cached_tokens == 16 and adm.restore_row == adm.state_row and len(m.tier.snapshots) == 1


def test_a_block_leaving_the_last_tier_invalidates_exactly_the_snapshots_tied_to_it():
    m = make(num_blocks=64, host_blocks=2)
    system = list(range(100, 108))
    run(m, "a", system + [1] * 9)                    # snapshot at 16
    run(m, "b", system + [2] * 5)                    # snapshots at the branch point 8 and at 12
    assert m.stats.snapshots_captured == 3
    m.evict_cached_blocks(2)                         # a's tail (blocks ending at 16, 12) to the host tier
    assert m.stats.snapshots_invalidated == 0 and len(m.tier.blocks) == 2
    held = {e.uid for e in m.tier.blocks.entries()}
    assert {t for t in m.registry.mamba_prefix_hashes_by_block if isinstance(t, tuple)} <= {host_terminal(u)
                                                                                             for u in held}
    m.evict_cached_blocks(1)                         # b's leaf comes in; the full host tier drops its LRU leaf (a's 16)
    assert m.stats.snapshots_invalidated == 1 and m.stats.tiers.host_blocks_dropped == 1
    adm = m.admit("c", system + [1] * 9)             # KV to 12 (device, then host); the branch point's state serves
    assert (adm.kv_matched_tokens, adm.num_cached_tokens) == (12, 8)
    assert m.admit("d", system + [2] * 5).num_cached_tokens == 12   # b's snapshot moved with its block


def test_a_recomputed_block_takes_over_the_host_copy():
    m = make(num_blocks=64, snaps=0, host_snaps=0, host_blocks=8)   # no snapshots: KV is matched, never used
    run(m, "a", list(range(9)))
    m.evict_cached_blocks(2)
    assert len(m.tier.blocks) == 2
    run(m, "b", list(range(9)))                      # recomputes both blocks and publishes them on the device
    assert len(m.tier.blocks) == 0 and m.blocks.num_cached == 2


def test_without_a_host_tier_evictions_drop_and_nothing_is_copied():
    m = make(host_blocks=0, host_snaps=0)
    run(m, "a", list(range(17)))
    run(m, "b", list(range(100, 117)))
    assert not m.take_transfers() and m.stats.snapshots_invalidated == 1
    assert m.admit("c", list(range(17))).num_cached_tokens == 0


def test_clear_drops_every_tier():
    m = make(num_blocks=64, snaps=1)
    run(m, "a", list(range(17)))
    run(m, "b", list(range(100, 117)))
    m.evict_cached_blocks(3)
    assert len(m.tier.blocks) and len(m.tier.snapshots)
    m.clear_prefix_cache()
    assert not len(m.tier.blocks) and not len(m.tier.snapshots) and not m.registry.valid_mamba_prefix_hashes
    assert m.admit("c", list(range(17))).num_cached_tokens == 0


def test_a_capture_where_the_kv_match_ran_to_the_prompt_end_is_a_prompt_end_not_a_branch_point():
    m = make(num_blocks=64, snaps=1, host_blocks=0, host_snaps=0)
    prompt = list(range(17))
    run(m, "a", prompt)                              # snapshot at 16
    run(m, "b", list(range(100, 117)))               # takes the only row; a's KV stays
    adm, _ = run(m, "c", prompt, output=[5] * 6)     # KV to 16, no state: captures 16 again, then finishes deeper
    assert (adm.kv_matched_tokens, adm.num_cached_tokens) == (16, 0)
    assert m.snapshots.origin(block_hashes(prompt, BS)[3]) is None   # a one-off prompt end: demoted, then evicted


def test_the_trace_replay_reuses_more_with_a_host_tier_and_after_a_restart():
    workloads = {name: WORKLOADS[name](random.Random(0), 0.3) for name in ("chat", "mixed")}
    settings = ReplaySettings(in_flight=4)
    sweep = host_tier_sweep(workloads, [60_000], [0.0, 1.0, 4.0], settings)
    for name, requests in workloads.items():
        reuse = [sweep[name]["60000"][m]["reuse"] for m in ("0.0", "1.0", "4.0")]
        assert reuse[0] < reuse[1] < reuse[2]
        tiered = sweep[name]["60000"]["4.0"]
        assert tiered["blocks_loaded"] + tiered["snapshots_loaded"] > 0
        restart = restart_replay(requests, 60_000, settings)
        assert restart["after_restart"]["reuse"] > restart["cold"]["reuse"]
