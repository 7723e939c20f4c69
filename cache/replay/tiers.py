"""qnext with a host tier, and after a restart, on the same traces and device memory (cache/tiers.py,
cache/cache_index.py).

- `host_tier_sweep`: reuse at each device budget with a host tier of 0x, 1x, 4x ... the device cache's KV blocks and
  snapshot rows (host RAM on top of the same device bytes).
- `restart_replay`: the trace replayed once (a cold start), the cache's index carried over as a restart with
  `prefix_cache_dir` does (into the new manager's host tier, sized like the device cache when no host tier is
  configured), and the trace replayed again; against a second replay in the same process (no restart).
"""
from dataclasses import replace

from cache.cache_index import export_index, import_index
from cache.replay.compare import ReplaySettings, build_manager
from cache.replay.loop import replay
from cache.replay.workloads import Request


def host_tier_sweep(workloads: dict[str, list[Request]], budgets: list[int], multiples: list[float],
                    settings: ReplaySettings = ReplaySettings()) -> dict:
    """{name: {budget: {multiple: replay result}}} for qnext."""
    out = {}
    for name, requests in workloads.items():
        out[name] = {}
        for budget in budgets:
            out[name][str(budget)] = {
                str(m): replay(build_manager("qnext", budget, replace(settings, host_multiple=m), requests),
                               requests, settings.in_flight, settings.chunk)
                for m in multiples}
    return out


def restart_replay(requests: list[Request], budget: int, settings: ReplaySettings = ReplaySettings()) -> dict:
    """Reuse of a cold first replay, of a second replay after a restart that kept the cache, and of a second
    replay without a restart."""
    restart_settings = replace(settings, host_multiple=max(settings.host_multiple, 1.0))
    first = build_manager("qnext", budget, restart_settings, requests)
    cold = replay(first, requests, settings.in_flight, settings.chunk)
    restarted = build_manager("qnext", budget, restart_settings, requests)
    import_index(restarted, export_index(first))
    after_restart = replay(restarted, requests, settings.in_flight, settings.chunk)
    same_process = replay(first, requests, settings.in_flight, settings.chunk)
    return {"cold": cold, "after_restart": after_restart, "same_process": same_process}
