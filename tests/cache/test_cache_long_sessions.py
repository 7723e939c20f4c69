"""Snapshots over long sessions: the pool sized by bytes, and checkpoint placement bounded per prompt."""
from cache import CacheConfig, CacheManager, plan_cache
from cache.checkpoint_spacing import MAX_CHECKPOINTS_PER_PROMPT, checkpoint_positions
from cache.sizing import SNAPSHOT_SPACING_TOKENS

MIB = 1 << 20


def test_checkpoints_are_bounded_per_prompt_and_nest_across_lengths():
    assert checkpoint_positions(20_000, 8192) == [8192, 16384]
    assert checkpoint_positions(262_144 + 100, 8192) == list(range(32768, 262_145, 32768))
    for n in (1, 8192, 8193, 65_536, 65_537, 100_000, 262_144, 1 << 20, (1 << 20) + 5):
        got = checkpoint_positions(n, 8192)
        assert len(got) <= MAX_CHECKPOINTS_PER_PROMPT and all(0 < p < n and p % 8192 == 0 for p in got)
        assert set(got) <= set(checkpoint_positions(min(n, 60_000), 8192)) | {p for p in got if p >= 60_000}
    assert checkpoint_positions(100_000, 0) == []


def test_a_256k_prompt_captures_a_bounded_set_including_its_turn_points():
    bs = 16
    m = CacheManager(CacheConfig(block_size=bs, num_blocks=(1 << 15) + 2, num_live_slots=1, num_snapshot_slots=64))
    prompt = list(range(262_144))
    m.admit("long", prompt, turn_starts=[100_005, 262_000])
    got = m.capture_positions("long")
    assert got == sorted({*range(32768, 262_144, 32768), 100_000, 262_000, 262_128, 262_144})
    assert len(got) <= MAX_CHECKPOINTS_PER_PROMPT + 4     # + the turn starts, the last boundary, the end


# tiny-model units (the demo: 8 KiB of KV per 16-token block, ~17 KiB per state row) and real-model units
TINY = dict(kv_bytes_per_block=8192, state_bytes_per_row=16896, block_size=16, max_num_seqs=8, max_model_len=16384)
REAL = dict(kv_bytes_per_block=64 * 24 * 1024, state_bytes_per_row=74 * MIB, block_size=64, max_num_seqs=8,
            max_model_len=32768)


def test_the_pool_is_sized_by_bytes_from_the_same_budget():
    old_rows = 4 * TINY["max_num_seqs"]                   # the former default cap, in rows
    budget = (8 * 1024 + 1) * TINY["kv_bytes_per_block"] + (1 + 8 + old_rows) * TINY["state_bytes_per_row"]
    capped = plan_cache(budget, max_num_snapshots=old_rows, **TINY)
    by_bytes = plan_cache(budget, **TINY)
    assert capped.num_snapshot_rows == old_rows
    assert by_bytes.num_snapshot_rows > 20 * old_rows
    for s in (capped, by_bytes):
        assert s.kv_bytes + s.state_bytes <= budget and budget - s.kv_bytes - s.state_bytes < 8192
    # the rows stay within what the KV can anchor, one per SNAPSHOT_SPACING_TOKENS, and the KV keeps most tokens
    assert by_bytes.num_snapshot_rows <= by_bytes.num_blocks * 16 // SNAPSHOT_SPACING_TOKENS + 1
    assert by_bytes.num_blocks * 16 >= 0.75 * capped.num_blocks * 16


def test_with_real_rows_the_snapshot_share_binds_not_the_anchor_bound():
    budget = 40 * 1024 * MIB
    s = plan_cache(budget, **REAL)
    shared = budget - 9 * REAL["state_bytes_per_row"]
    assert s.num_snapshot_rows == int(0.75 * shared) // REAL["state_bytes_per_row"]


def test_a_request_arriving_during_a_siblings_prefill_resumes_near_its_published_kv():
    """Agents' first requests arrive together: B is admitted while A (same 7.5k-token system prompt) is in its
    last prefill step, so A has published 7 x 1024 tokens of KV. A checkpoint every 1k lets B resume there."""
    bs = 16
    m = CacheManager(CacheConfig(block_size=bs, num_blocks=2048, num_live_slots=2, num_snapshot_slots=64))
    system = list(range(7500))
    a, b = system + [1] * 600, system + [2] * 600
    assert m.admit("a", a).num_cached_tokens == 0
    captures = m.capture_positions("a")
    assert [p for p in captures if p <= 7168] == list(range(1024, 7169, 1024))
    for end in range(1024, 7169, 1024):                  # A's steps of 1024 tokens, capturing where planned
        m.reserve_capture("a", end)
        m.commit("a", a, end)
    adm = m.admit("b", b)
    assert adm.kv_matched_tokens == 7168 and adm.num_cached_tokens == 7168
