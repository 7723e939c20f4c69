import pytest

from cache import plan_cache

MIB = 1 << 20
# Qwen3-Next-80B-like units: 24 KiB of KV per token, 74 MiB per state row
BS, ROW = 64, 74 * MIB
KV_BLOCK = BS * 24 * 1024


def plan(budget, **kw):
    args = dict(kv_bytes_per_block=KV_BLOCK, state_bytes_per_row=ROW, block_size=BS, max_num_seqs=8,
                max_model_len=32768)
    return plan_cache(budget, **{**args, **kw})


def test_live_rows_first_then_the_snapshot_share_then_kv_blocks():
    budget = 40 * 1024 * MIB
    s = plan(budget, snapshot_memory_fraction=0.25)
    shared = budget - 9 * ROW                                   # zero row + 8 live rows first
    assert s.num_live_rows == 8 and s.num_snapshot_rows == int(0.25 * shared) // ROW
    assert s.state_bytes == (9 + s.num_snapshot_rows) * ROW
    assert s.kv_bytes == (s.num_blocks + 1) * KV_BLOCK
    assert 0 <= budget - s.kv_bytes - s.state_bytes < KV_BLOCK  # the rest is KV, to the block
    assert plan(budget, snapshot_memory_fraction=0.0).num_snapshot_rows == 0


def test_byte_and_count_caps_bound_the_snapshot_side_and_kv_gets_the_rest():
    budget = 40 * 1024 * MIB
    free = plan(budget, snapshot_memory_fraction=0.5)
    by_count = plan(budget, snapshot_memory_fraction=0.5, max_num_snapshots=10)
    by_bytes = plan(budget, snapshot_memory_fraction=0.5, snapshot_memory_bytes=5 * ROW + 1)
    assert free.num_snapshot_rows > 10 and by_count.num_snapshot_rows == 10 and by_bytes.num_snapshot_rows == 5
    assert by_bytes.num_blocks > by_count.num_blocks > free.num_blocks
    assert "max_num_snapshots 10" not in by_count.describe()
    assert "max_num_snapshots 1000 cut to" in plan(budget, max_num_snapshots=1000).describe()


def test_snapshots_never_squeeze_kv_below_one_full_sequence():
    one_seq = (1 + 32768 // BS) * KV_BLOCK
    budget = 9 * ROW + one_seq + 3 * ROW
    s = plan(budget, snapshot_memory_fraction=1.0)
    assert s.num_blocks == 32768 // BS and s.num_snapshot_rows == 3


def test_a_budget_below_one_sequence_says_what_it_needs():
    need = 9 * ROW + (1 + 32768 // BS) * KV_BLOCK
    with pytest.raises(ValueError, match=f"cache budget {need - 1} bytes .* {need} in all"):
        plan(need - 1)
    assert plan(need).num_blocks == 32768 // BS


def test_a_model_without_state_rows_gets_no_snapshot_rows():
    s = plan(8 * 1024 * MIB, state_bytes_per_row=0)
    assert s.num_snapshot_rows == 0 and s.state_bytes == 0 and s.num_blocks == 8 * 1024 * MIB // KV_BLOCK - 1


def test_log_line_and_dict():
    s = plan(40 * 1024 * MIB)
    line = s.describe()
    assert f"{s.num_blocks} KV blocks = {s.num_blocks * BS} tokens" in line
    assert "8 live state rows" in line and f"{s.num_snapshot_rows} snapshot rows" in line and "\n" not in line
    assert set(s.as_dict()) == {"num_blocks", "block_size", "kv_bytes", "num_live_rows", "num_snapshot_rows",
                                "num_staging_rows", "state_bytes", "budget_bytes"}
    assert s.as_dict()["kv_bytes"] + s.as_dict()["state_bytes"] <= s.budget_bytes


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="snapshot_memory_fraction=1.5"):
        plan(40 * 1024 * MIB, snapshot_memory_fraction=1.5)
    with pytest.raises(ValueError, match="max_num_snapshots=-1"):
        plan(40 * 1024 * MIB, max_num_snapshots=-1)
