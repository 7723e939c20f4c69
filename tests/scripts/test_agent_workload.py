"""The agent workload's bookkeeping (qnext/bench/agent_workload.py): bounded tool schemas, and the split of every
prompt token into cached / appended / re-rendered / straddling / lost-to-a-missing-state / other."""
from __future__ import annotations

import jsonschema

from qnext.bench.agent_workload import SentRequest, explain_recompute, tool_schemas


def test_tool_schemas_are_valid_and_bounded():
    tools = tool_schemas(14)
    assert len({t["function"]["name"] for t in tools}) == 14
    for t in tools:
        schema = t["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(schema)
        for prop in schema["properties"].values():
            assert prop["type"] != "string" or "maxLength" in prop or "enum" in prop


def test_recompute_reasons_add_up():
    b = 4
    first = SentRequest(list(range(10)), [100, 101, 102], cached=0, missing_state=0, session=0)
    # keeps the first's prompt, then its output and 3 new tokens: 12 of 13 seen tokens are block-aligned, cached
    second = SentRequest(list(range(10)) + [100, 101, 102, 7, 8, 9], [103], cached=12, missing_state=0, session=0)
    # a new user turn that re-renders history: diverges after 6 tokens; only 4 cached, 0 lost to a state
    third = SentRequest(list(range(6)) + [55, 56, 57], [104], cached=4, missing_state=0, session=0)
    # another session's first request, sent before any of these finished: nothing seen
    other = SentRequest(list(range(5)) + [9, 9], [1], cached=0, missing_state=0, session=1)
    requests = [first, second, third, other]
    totals = explain_recompute(requests, [[], [0], [0, 1], []], b)
    assert first.reasons == {"new": 10, "appended": 0, "rerendered": 10, "straddle": 0, "cached": 0,
                             "missing_state": 0, "other": 0}
    assert second.reasons["appended"] == 3 and second.reasons["straddle"] == 1 and second.reasons["cached"] == 12
    # keeps the first's prompt but renders its output differently: appended from the divergence on
    fourth = SentRequest(list(range(10)) + [100, 7, 7], [1], cached=8, missing_state=0, session=0)
    explain_recompute([first, fourth], [[], [0]], b)
    assert fourth.reasons["appended"] == 2 and fourth.reasons["rerendered"] == 0
    assert third.reasons["rerendered"] == 3 and third.reasons["straddle"] == 2 and third.reasons["other"] == 0
    assert other.reasons["new"] == 7
    assert totals["prompt"] == sum(len(r.prompt_ids) for r in requests)
    for r in requests:     # every prompt token has exactly one reason
        assert r.reasons["new"] + r.reasons["straddle"] + r.reasons["cached"] + r.reasons["missing_state"] \
            + r.reasons["other"] == len(r.prompt_ids)


def test_a_warm_up_counts_as_seen():
    warm = SentRequest([1, 2, 3, 4, 5, 6, 7, 8], [9], cached=0, missing_state=0, session=0)
    r = SentRequest([1, 2, 3, 4, 5, 6, 7, 8, 20], [9], cached=4, missing_state=4, session=0)
    explain_recompute([r], [[]], 4, earlier=[warm])
    assert r.reasons["new"] == 1 and r.reasons["missing_state"] == 4 and r.reasons["other"] == 0
