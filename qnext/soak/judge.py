"""The soak's pass criteria (plain Python): each request's outcome against the fault windows, resource growth over
the second half, the idle check of the cache's pools."""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from qnext.soak.monitor import Sample

MAX_RSS_GROWTH = 0.02           # over the second half, the target
MAX_FD_GROWTH = 4               # a few sockets may be open at either end of the window
MAX_THREAD_GROWTH = 4
FAULT_GRACE_S = 20.0            # a designed 503 may come this long after its fault ended
IN_FLIGHT_S = 1.0               # a request sent this long before a drain began had reached the server (not a
                                # connection still in the listener's backlog, which closing the listener resets)
IDLE_GAUGES = ("qnext:num_requests_running", "qnext:num_requests_waiting", "qnext:kv_cache_usage_perc",
               "qnext:state_slots_usage_perc")


@dataclass
class Outcome:
    kind: str
    expect: str                  # "ok" (2xx), "client_error" (4xx) or "any" (a client that leaves on purpose)
    status: int | str            # the HTTP status, or "timeout", "connection" (refused / reset), "left"
    start: float                 # seconds since the load began
    end: float
    detail: str = ""
    mismatch: bool = False       # a greedy probe whose answer differs from the same request run alone


@dataclass
class FaultWindow:
    name: str
    start: float
    end: float
    shape_wide: bool = False     # the whole shape is down (a restart): connection errors are designed too
    drains: bool = False         # a SIGTERM drain: what was in flight when it began must still be answered


@dataclass
class Verdict:
    counts: Counter = field(default_factory=Counter)    # (kind, status) -> requests
    designed: Counter = field(default_factory=Counter)  # fault -> requests that got its designed answer
    unexpected: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.unexpected


def _window(o: Outcome, windows: list[FaultWindow]) -> FaultWindow | None:
    for w in windows:
        if o.end >= w.start and o.start <= w.end + FAULT_GRACE_S:
            return w
    return None


def judge_outcomes(outcomes: list[Outcome], windows: list[FaultWindow]) -> Verdict:
    v = Verdict()
    for o in outcomes:
        v.counts[f"{o.kind} {o.status}"] += 1
        window = _window(o, windows)
        if o.status == "timeout":
            v.unexpected.append(f"{o.kind}: no answer within the deadline ({o.detail})")
        elif o.mismatch:
            v.unexpected.append(f"{o.kind}: greedy answer differs from the same request alone ({o.detail})")
        elif o.expect == "any" or (o.expect == "ok" and o.status == 200) or \
                (o.expect == "client_error" and isinstance(o.status, int) and 400 <= o.status < 500):
            if o.expect == "any" and isinstance(o.status, int) and o.status >= 500 and window is None:
                v.unexpected.append(f"{o.kind}: {o.status} outside any fault ({o.detail})")
        elif window is not None and window.drains and o.start < window.start - IN_FLIGHT_S and o.kind != "never_read":
            v.unexpected.append(f"{o.kind}: in flight when {window.name} began, it got {o.status} ({o.detail})")
        elif window is not None and (o.status == 503 or (o.status == "connection" and window.shape_wide)):
            v.designed[window.name] += 1
        else:
            v.unexpected.append(f"{o.kind}: got {o.status}, expected {o.expect} at t={o.start:.1f}s ({o.detail})")
    return v


def resource_growth(samples: list[Sample], second_half_from: float, until: float | None = None) -> dict:
    """Growth of RSS (a fraction), fds and threads over the second half (up to `until`, a terminal fault), on the
    processes alive at its end (a window cut by a restart starts after it). Medians of the first and last three
    samples smooth single blips."""
    samples = [s for s in samples if until is None or s.t < until]
    if not samples:
        return {"error": "no samples"}
    last_pids = samples[-1].pids
    window = [s for s in samples if s.t >= second_half_from and s.pids == last_pids]
    if len(window) < 6:
        return {"error": f"only {len(window)} samples of the final processes in the second half"}
    first, last = window[:3], window[-3:]

    def median(xs, key):
        return statistics.median(getattr(s, key) for s in xs)
    rss0, rss1 = median(first, "rss_bytes"), median(last, "rss_bytes")
    return {"samples": len(window), "seconds": round(window[-1].t - window[0].t, 1),
            "rss_mib_start": round(rss0 / 2**20, 1), "rss_mib_end": round(rss1 / 2**20, 1),
            "rss_growth": round((rss1 - rss0) / rss0, 4),
            "rss_mib_by_process": {name: [round(first[-1].rss_by_process.get(name, 0) / 2**20, 1),
                                          round(last[-1].rss_by_process.get(name, 0) / 2**20, 1)]
                                   for name in (last[-1].rss_by_process or {})},
            "fds_start": median(first, "fds"), "fds_end": median(last, "fds"),
            "threads_start": median(first, "threads"), "threads_end": median(last, "threads"),
            "rss_mib_series": rss_series(samples)}


def rss_series(samples: list[Sample], points: int = 24) -> list[list]:
    """The whole run's RSS, `points` samples evenly spread: [seconds, total MiB, {process: MiB}] each. Not judged:
    it tells a plateau (warm-up) from steady growth (a leak), which the second half's two ends cannot."""
    step = max(1, -(-len(samples) // points))
    picked = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    return [[round(s.t, 1), round(s.rss_bytes / 2**20, 1),
             {name: round(b / 2**20, 1) for name, b in (s.rss_by_process or {}).items()}] for s in picked]


def judge_resources(growth: dict) -> list[str]:
    if "error" in growth:
        return [f"resources: {growth['error']}"]
    wrong = []
    if growth["rss_growth"] > MAX_RSS_GROWTH:
        wrong.append(f"RSS grew {100 * growth['rss_growth']:.1f}% over the second half "
                     f"(limit {100 * MAX_RSS_GROWTH:.0f}%)")
    if growth["fds_end"] - growth["fds_start"] > MAX_FD_GROWTH:
        wrong.append(f"open files grew from {growth['fds_start']} to {growth['fds_end']}")
    if growth["threads_end"] - growth["threads_start"] > MAX_THREAD_GROWTH:
        wrong.append(f"threads grew from {growth['threads_start']} to {growth['threads_end']}")
    return wrong


def metric_values(text: str, name: str) -> list[float]:
    """Every sample of gauge `name` in Prometheus text (one per label set)."""
    out = []
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


def judge_idle(metrics_text: str) -> list[str]:
    """When no request is in flight every pool but the cached prefixes is empty: no request running or waiting, no
    KV block referenced, no live state row held."""
    wrong = []
    for name in IDLE_GAUGES:
        values = metric_values(metrics_text, name)
        if not values:
            wrong.append(f"idle: /metrics has no {name}")
        elif any(v != 0 for v in values):
            wrong.append(f"idle: {name} = {values} (expected 0)")
    return wrong
