"""The clairvoyant schedule (belady) and the upper bound on tiny traces whose answers are known by hand."""
import random

import pytest

from cache.replay import (WORKLOADS, ReplaySettings, Request, belady_reuse, cache_memory, compare, reuse_bound,
                          trace_facts)

BS, ROW = 4, 8          # 4-token blocks, a snapshot costs 8 tokens of KV


def two_conversations() -> list[Request]:
    """A1, B1, A2, B2: A2 reuses A1's 12 computed tokens (3 blocks + their snapshot: 20 tokens of memory), B2 B1's 8
    (16 tokens of memory); A1 holds 3 blocks while it runs, B1 2, A2 5, B2 4."""
    a1, b1 = Request(tuple(range(1, 9)), tuple(range(20, 25))), Request(tuple(range(101, 105)), tuple(range(120, 125)))
    a2 = Request(a1.prompt_token_ids + a1.output_token_ids + (30, 31, 32, 33), (9,))
    b2 = Request(b1.prompt_token_ids + b1.output_token_ids + (130, 131, 132, 133), (9,))
    return [a1, b1, a2, b2]


def test_trace_facts_reusable_depth_and_last_holder():
    facts = trace_facts(two_conversations(), BS)
    assert facts.depth == [0, 0, 3, 2] and facts.own_blocks == [3, 2, 5, 4]
    assert facts.last_touch[2] == [0, 0, 0] and facts.last_touch[3] == [1, 1]
    assert facts.prompt_tokens == 42


def test_belady_keeps_the_conversation_that_returns_first():
    """In 32 tokens, after B1 both ends want 36, so the end used farthest away (B's) goes and A2 reuses its 12
    tokens. Dropping A's end instead (or keeping B's, the most recent, as an LRU does) reuses nothing: A2's 5 blocks
    beside B's end need 36 too. The bound: the LP's optimum is 12 + 8 * 0.75 = 18 (x_B <= 0.75 while A2 runs
    beside B's end), below the unbounded reuse of 20."""
    facts = trace_facts(two_conversations(), BS)
    result = belady_reuse(facts, 32, BS, ROW)
    assert result["reused_tokens"] == 12 and result["plans_dropped"] == 1
    bound = reuse_bound(facts, 32, BS, ROW, lower=12, iterations=3000)
    assert 12 <= bound["reused_tokens"] <= 18 + 0.5


def test_everything_fits_belady_and_bound_equal_the_unbounded_reuse():
    facts = trace_facts(two_conversations(), BS)
    assert belady_reuse(facts, 36, BS, ROW)["reused_tokens"] == 20
    assert reuse_bound(facts, 36, BS, ROW, lower=20)["reused_tokens"] == pytest.approx(20)


def test_one_document_snapshot_serves_each_later_question_in_tight_memory():
    """Three requests on one 8-token document: in room for one running request (3 blocks) and one snapshot, the
    document's blocks and snapshot serve the second and the third (8 tokens each)."""
    doc = tuple(range(1, 9))
    reqs = [Request(doc + (50, 51), (52,)), Request(doc + (60, 61), (62,)),
            Request(doc + (50, 51, 52, 70, 71, 72), (73,))]
    facts = trace_facts(reqs, BS)
    assert facts.depth == [0, 2, 2]
    assert belady_reuse(facts, 3 * BS + ROW, BS, ROW)["reused_tokens"] == 16


def test_a_request_that_does_not_fit_alone_is_a_clear_error():
    facts = trace_facts(two_conversations(), BS)
    with pytest.raises(ValueError, match="request 2 needs 20 tokens"):
        belady_reuse(facts, 16, BS, ROW)
    with pytest.raises(ValueError, match="live rows"):
        cache_memory(100, 8, 3000, 64)


def test_replay_table_orders_qnext_belady_bound_oracle():
    """On small workloads at several budgets: belady's schedule never beats the bound, the bound never beats the
    unbounded oracle's reuse, and where memory is short the bound is below the oracle."""
    settings = ReplaySettings(in_flight=4)
    workloads = {name: make(random.Random(0), 0.3) for name, make in WORKLOADS.items()}
    results = compare(workloads, [30_000, 150_000], ("qnext", "oracle", "belady", "bound"), settings)
    below = 0
    for w in results["workloads"].values():
        for row in w["budgets"].values():
            assert row["belady"]["reused_tokens"] <= row["bound"]["reused_tokens"] + 1e-6
            assert row["bound"]["reuse"] <= row["oracle"]["reuse"] + 1e-9
            below += row["bound"]["reuse"] < row["oracle"]["reuse"] - 0.01
    assert below >= 1
