"""Trace replay of the prefix cache: workloads, the engine loop on the host, other engines' policies as models.

    from cache.replay import WORKLOADS, ReplaySettings, compare
    results = compare({"chat": WORKLOADS["chat"](random.Random(0))}, budgets=[300_000])
"""
from cache.replay.belady import belady_reuse, cache_memory, trace_facts
from cache.replay.compare import (POLICIES, ReplaySettings, build_manager, compare, ordering_violations,
                                  snapshot_share_sweep)
from cache.replay.loop import replay
from cache.replay.peers import DisableAllPolicy, OraclePolicy, SeedPolicy, SGLangPolicy
from cache.replay.reuse_bound import reuse_bound
from cache.replay.workloads import WORKLOADS, Request, load_trace

__all__ = ["POLICIES", "WORKLOADS", "DisableAllPolicy", "OraclePolicy", "ReplaySettings", "Request",
           "SGLangPolicy", "SeedPolicy", "belady_reuse", "build_manager", "cache_memory", "compare", "load_trace",
           "ordering_violations", "replay", "reuse_bound", "snapshot_share_sweep", "trace_facts"]
