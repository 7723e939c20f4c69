"""The soak's pass criteria (qnext/soak/judge.py) fail where they should: a 5xx outside a fault, an unanswered
request, a greedy answer changed by load, resource growth, a pool not empty when idle."""
from __future__ import annotations

from qnext.soak.judge import (FaultWindow, Outcome, judge_idle, judge_outcomes, judge_resources, metric_values,
                              resource_growth)
from qnext.soak.monitor import Sample, process_tree, sample

KILL = FaultWindow("kill -9 of a replica", start=10.0, end=12.0)
RESTART = FaultWindow("SIGTERM drain", start=30.0, end=40.0, shape_wide=True)


def test_outcomes_pass_when_every_answer_is_the_expected_one():
    v = judge_outcomes([Outcome("chat", "ok", 200, 1, 2), Outcome("bad", "client_error", 400, 1, 2),
                        Outcome("disconnect", "any", "left", 1, 2)], [])
    assert v.passed and v.counts == {"chat 200": 1, "bad 400": 1, "disconnect left": 1}


def test_a_5xx_fails_outside_a_fault_and_is_designed_inside_one():
    assert not judge_outcomes([Outcome("chat", "ok", 500, 1, 2)], [KILL]).passed
    assert not judge_outcomes([Outcome("chat", "ok", 503, 1, 2)], [KILL]).passed      # before the fault
    inside = judge_outcomes([Outcome("chat", "ok", 503, 11, 11.5)], [KILL])
    assert inside.passed and inside.designed == {"kill -9 of a replica": 1}
    assert not judge_outcomes([Outcome("chat", "ok", 500, 11, 11.5)], [KILL]).passed  # only 503 is designed
    assert not judge_outcomes([Outcome("bad", "client_error", 500, 1, 2)], []).passed


def test_refused_connections_are_designed_only_while_the_whole_shape_restarts():
    assert judge_outcomes([Outcome("chat", "ok", "connection", 35, 35)], [RESTART]).passed
    assert not judge_outcomes([Outcome("chat", "ok", "connection", 11, 11)], [KILL]).passed


def test_a_hanging_request_or_a_changed_greedy_answer_fails():
    assert not judge_outcomes([Outcome("chat", "ok", "timeout", 1, 121)], []).passed
    assert not judge_outcomes([Outcome("probe", "ok", 200, 1, 2, mismatch=True)], []).passed
    assert not judge_outcomes([Outcome("chat_stream", "ok", "truncated", 1, 2)], []).passed


def _samples(rss_end: int, fds_end: int = 30, threads_end: int = 20) -> list[Sample]:
    first = [Sample(t, 1000, 30, 20, (1,)) for t in range(0, 50, 5)]
    second = [Sample(50 + t, 1000 + (rss_end - 1000) * t // 45, 30 + (fds_end - 30) * t // 45,
                     20 + (threads_end - 20) * t // 45, (1,)) for t in range(0, 50, 5)]
    return first + second


def test_resources_fail_on_growth_over_the_second_half():
    flat = resource_growth(_samples(1010), second_half_from=50)
    assert flat["rss_growth"] < 0.02 and judge_resources(flat) == []
    assert judge_resources(resource_growth(_samples(1100), 50))          # 10% RSS
    assert judge_resources(resource_growth(_samples(1000, fds_end=60), 50))
    assert judge_resources(resource_growth(_samples(1000, threads_end=40), 50))
    restarted = _samples(1000)[:-6] + [Sample(90 + t, 1000, 30, 20, (2,)) for t in range(3)]
    assert "error" in resource_growth(restarted, 50)                    # too few samples of the final process


def test_the_report_has_the_whole_runs_rss_to_tell_a_plateau_from_a_leak():
    mib = 2**20
    samples = [Sample(t, (500 + t) * mib, 30, 20, (1,), {"front": (400 + t) * mib, "replica": 100 * mib})
               for t in range(0, 100, 2)]
    series = resource_growth(samples, 50)["rss_mib_series"]
    assert 2 <= len(series) <= 25 and series[0] == [0, 500.0, {"front": 400.0, "replica": 100.0}]
    assert series[-1] == [98, 598.0, {"front": 498.0, "replica": 100.0}]
    assert [p[1] for p in series] == sorted(p[1] for p in series) and series[1][1] > 500


def test_idle_pools_must_be_empty():
    text = ('# HELP qnext:kv_cache_usage_perc x\nqnext:kv_cache_usage_perc{model_name="m"} 0.0\n'
            'qnext:num_requests_running{model_name="m"} 0.0\nqnext:num_requests_waiting{model_name="m"} 0.0\n'
            'qnext:state_slots_usage_perc{model_name="m"} 0.0\nqnext:kv_cache_usage_perc_other 3\n')
    assert metric_values(text, "qnext:kv_cache_usage_perc") == [0.0]
    assert judge_idle(text) == []
    assert judge_idle(text.replace('qnext:state_slots_usage_perc{model_name="m"} 0.0',
                                   'qnext:state_slots_usage_perc{model_name="m"} 0.25'))
    assert judge_idle("")                                                # missing gauges fail too


def test_the_monitor_reads_this_process():
    import os

    s = sample([os.getpid()], 0.0)
    assert s.rss_bytes > 10 << 20 and s.fds > 0 and s.threads >= 1 and os.getpid() in process_tree(os.getpid())


def test_a_drain_must_answer_what_was_in_flight():
    drain = FaultWindow("SIGTERM drain", start=30.0, end=40.0, shape_wide=True, drains=True)
    assert judge_outcomes([Outcome("chat", "ok", "connection", 31, 31)], [drain]).passed     # sent while draining
    assert judge_outcomes([Outcome("chat", "ok", 200, 29, 32)], [drain]).passed
    assert not judge_outcomes([Outcome("chat", "ok", "connection", 28, 31)], [drain]).passed  # in flight, dropped


def test_the_resource_window_ends_where_a_terminal_fault_begins():
    samples = _samples(1000) + [Sample(100 + t, 5000, 99, 99, (2,)) for t in range(5)]    # a rank died at 100 s
    assert "error" in resource_growth(samples, 50)
    assert judge_resources(resource_growth(samples, 50, until=100)) == []
