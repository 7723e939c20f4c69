"""qnext's policy against its peers on the same requests and the same memory, and the snapshot-share trade-off.

Memory is counted in tokens of KV: one token of full-attention KV costs 1, one state row (live or snapshot) costs
`state_kv_tokens` (3000 for Qwen3-Next-80B: 74 MiB of fp32 GDN state vs 24 KiB of KV per token). A budget is the
total shared by KV blocks, live state rows and snapshot rows (the dummy block and the zero row are not counted, for
any policy); each policy splits it by its own rule. Policies that keep less memory for KV admit fewer requests at
once, which can raise their reuse on a shared prefix; the replay models that but reports reuse, not throughput.
"""
from dataclasses import dataclass, replace

from cache.config import CacheConfig
from cache.hashing import block_hashes
from cache.manager import CacheManager
from cache.policy import CachePolicy
from cache.replay.belady import belady_reuse, cache_memory, trace_facts
from cache.replay.loop import replay
from cache.replay.reuse_bound import reuse_bound
from cache.replay.peers import DisableAllPolicy, OraclePolicy, SeedPolicy, SGLangPolicy
from cache.replay.workloads import Request
from cache.sizing import DEFAULT_SNAPSHOT_MEMORY_FRACTION, plan_cache

POLICIES = ("kv-only", "disable-all", "seed", "sglang", "qnext", "oracle", "belady", "bound")
CLAIRVOYANT = ("oracle", "belady", "bound")   # know the trace in advance: not online policies
PEER_POLICIES = {"disable-all": DisableAllPolicy, "seed": SeedPolicy, "sglang": SGLangPolicy, "oracle": OraclePolicy}


@dataclass(frozen=True)
class ReplaySettings:
    block_size: int = 64
    in_flight: int = 8                 # requests running at once (= live state rows)
    chunk: int = 2048                  # prefill chunk in tokens
    state_kv_tokens: int = 3000        # memory of one state row, in tokens of KV
    snapshot_memory_fraction: float = DEFAULT_SNAPSHOT_MEMORY_FRACTION   # qnext's knob (cache/sizing.py)
    sglang_mamba_full_memory_ratio: float = 0.9   # state pool : KV = 0.9 : 1; 2 rows per running request not cache
    seed_snapshots_per_live_row: int = 2          # bounded so that KV keeps at least half of the non-live memory
    host_multiple: float = 0.0         # qnext's host tier: this many times its device KV blocks and snapshot rows


def build_manager(policy: str, budget: int, settings: ReplaySettings, requests: list[Request]) -> CacheManager:
    """A manager whose KV blocks and snapshot rows split `budget` by the policy's own rule (the oracle gets room for
    every block and boundary state of `requests`, one request at a time)."""
    bs, r, live = settings.block_size, settings.state_kv_tokens, settings.in_flight
    rest = budget - live * r
    if policy == "oracle":
        blocks = sum(len(q.prompt_token_ids) + len(q.output_token_ids) for q in requests) // bs + 2 * len(requests)
        snaps, live = blocks, 1
    elif policy == "kv-only":
        blocks, snaps = rest // bs, 0
    elif policy in ("seed", "disable-all"):
        snaps = min(settings.seed_snapshots_per_live_row * live, rest // 2 // r)
        blocks = (rest - snaps * r) // bs
    elif policy == "sglang":
        ratio = settings.sglang_mamba_full_memory_ratio
        rows = int(budget * ratio / (1 + ratio)) // r
        snaps = max(0, rows - 2 * live)
        blocks = (budget - rows * r) // bs
    elif policy == "qnext":
        sizes = plan_cache(budget + bs + r, kv_bytes_per_block=bs, state_bytes_per_row=r, block_size=bs,
                           max_num_seqs=live, snapshot_memory_fraction=settings.snapshot_memory_fraction,
                           max_model_len=max(len(q.prompt_token_ids) + len(q.output_token_ids) for q in requests))
        blocks, snaps = sizes.num_blocks, sizes.num_snapshot_rows
    else:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    if blocks < 2:
        raise ValueError(f"budget {budget} leaves {policy} {blocks} KV blocks; raise the budget")
    host = settings.host_multiple if policy == "qnext" else 0.0
    config = CacheConfig(block_size=bs, num_blocks=blocks + 1, num_live_slots=live, num_snapshot_slots=snaps,
                         num_host_blocks=int(host * blocks), num_host_snapshot_slots=int(host * snaps))
    return CacheManager(config, PEER_POLICIES.get(policy, CachePolicy)())


def compare(workloads: dict[str, list[Request]], budgets: list[int], policies=POLICIES,
            settings: ReplaySettings = ReplaySettings()) -> dict:
    """Replay every workload under every policy and budget: {"workloads": {name: {"budgets": {budget: {policy:
    replay result}}}}}. The oracle runs one request at a time with unbounded memory, once per workload; belady (a
    clairvoyant schedule) and bound (an upper bound on any schedule) one at a time in qnext's memory less its live
    rows (cache/replay/belady.py, reuse_bound.py)."""
    results = {"budgets": list(budgets), "policies": list(policies), "workloads": {}}
    for name, requests in workloads.items():
        oracle = None
        if "oracle" in policies:
            oracle = replay(build_manager("oracle", 0, settings, requests), requests, 1, settings.chunk)
        facts = trace_facts(requests, settings.block_size) if {"belady", "bound"} & set(policies) else None
        per_budget = {}
        for budget in budgets:
            row = per_budget[str(budget)] = {
                policy: oracle if policy == "oracle" else
                replay(build_manager(policy, budget, settings, requests), requests, settings.in_flight, settings.chunk)
                for policy in policies if policy not in ("belady", "bound")}
            if facts is not None:
                row.update(clairvoyant(facts, budget, settings))
            per_budget[str(budget)] = {p: row[p] for p in policies}
        results["workloads"][name] = {"num_requests": len(requests),
                                      "prompt_tokens": sum(len(q.prompt_token_ids) for q in requests),
                                      "oracle_working_set": oracle_working_set(requests, settings),
                                      "budgets": per_budget}
    return results


def clairvoyant(facts, budget: int, settings: ReplaySettings) -> dict:
    """{"belady": its replay, "bound": the upper bound} at `budget` (cache/replay/belady.py, reuse_bound.py)."""
    bs, row = settings.block_size, settings.state_kv_tokens
    memory = cache_memory(budget, settings.in_flight, row, bs)
    belady = belady_reuse(facts, memory, bs, row)
    return {"belady": belady, "bound": reuse_bound(facts, memory, bs, row, lower=belady["reused_tokens"])}


def oracle_working_set(requests: list[Request], settings: ReplaySettings = ReplaySettings()) -> int:
    """Memory, in KV tokens, that the oracle's reuse needs at once: the peak over the trace (one request at a time)
    of the KV blocks and snapshots that were computed before and are reused later (each request reuses its longest
    block prefix that an earlier request had, ending at a snapshot), plus `in_flight` live state rows."""
    bs, row = settings.block_size, settings.state_kv_tokens
    born: dict[bytes, int] = {}
    last_use: dict[tuple[bytes, int], int] = {}          # (hash, size in KV tokens) -> last request that reuses it
    for j, q in enumerate(requests):
        hashes = block_hashes(q.prompt_token_ids + q.output_token_ids, bs)
        own = hashes[:(len(q.prompt_token_ids) - 1) // bs]
        depth = next((i for i, h in enumerate(own) if h not in born), len(own))
        last_use.update({(h, bs): j for h in own[:depth]})
        if depth:
            last_use[(own[depth - 1], row)] = j
        for h in hashes:
            born.setdefault(h, j)
    change = [0] * (len(requests) + 1)
    for (h, size), last in last_use.items():
        change[born[h]] += size
        change[last] -= size
    held = peak = 0
    for delta in change:
        held += delta
        peak = max(peak, held)
    return peak + settings.in_flight * row


def snapshot_share_sweep(workloads: dict[str, list[Request]], budgets: list[int], fractions: list[float],
                         settings: ReplaySettings = ReplaySettings()) -> dict:
    """qnext at each snapshot_memory_fraction, at fixed total memory: {name: {budget: {fraction: {"reuse", "steps",
    "preempted"}}}} (steps: fewer KV blocks can admit fewer requests at once)."""
    out = {}
    for name, requests in workloads.items():
        out[name] = {}
        for budget in budgets:
            row = out[name][str(budget)] = {}
            for f in fractions:
                mgr = build_manager("qnext", budget, replace(settings, snapshot_memory_fraction=f), requests)
                r = replay(mgr, requests, settings.in_flight, settings.chunk)
                row[str(f)] = {key: r[key] for key in ("reuse", "steps", "preempted")}
    return out


def ordering_violations(results: dict) -> list[str]:
    """Places where qnext reuses fewer tokens than an online policy."""
    bad = []
    for name, w in results["workloads"].items():
        for budget, row in w["budgets"].items():
            best = row.get("qnext", {}).get("reused_tokens")
            for policy, r in row.items():
                if best is not None and policy != "qnext" and policy not in CLAIRVOYANT and r["reused_tokens"] > best:
                    bad.append(f"{name} @ {budget}: {policy} reused {r['reused_tokens']} > qnext {best}")
    return bad

