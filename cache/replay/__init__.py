"""Trace replay of the prefix cache: workloads, the engine loop on the host, other engines' policies as models.

    from cache.replay import WORKLOADS, ReplaySettings, compare
    results = compare({"chat": WORKLOADS["chat"](random.Random(0))}, budgets=[300_000])
"""
from cache.replay.compare import (POLICIES, ReplaySettings, build_manager, compare, ordering_violations,
                                  snapshot_share_sweep)
from cache.replay.loop import replay
from cache.replay.peers import DisableAllPolicy, OraclePolicy, SeedPolicy, SGLangPolicy
from cache.replay.workloads import WORKLOADS, Request, load_trace

__all__ = ["POLICIES", "WORKLOADS", "DisableAllPolicy", "OraclePolicy", "ReplaySettings", "Request",
           "SGLangPolicy", "SeedPolicy", "build_manager", "compare", "load_trace", "ordering_violations", "replay",
           "snapshot_share_sweep"]
