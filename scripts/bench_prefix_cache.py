"""Prefix-cache reuse for a hybrid (GDN + attention) model: qnext's policy against its peers, same trace, same bytes.

Every policy replays the same requests through the real `cache.CacheManager` machinery (block pool, leaf-LRU prefix
cache, snapshot registry and pool); model compute is replaced by token accounting, so a run takes seconds and is
deterministic. Memory is counted in "KV tokens": one token of full-attention KV costs 1, one state row (live or
snapshot) costs --snapshot-kv-tokens (default 3000, the Qwen3-Next-80B ratio: 74 MiB of fp32 GDN state vs 24 KiB of
KV per token). Each budget is the total shared by KV blocks, live state rows and snapshots; each policy splits it
by its own rule.

The engine loop being modelled: up to --in-flight requests run at once, admitted in trace order (head-of-line
blocking when one does not fit); every step each running request either prefills one chunk (--chunk tokens, cut
at the capture positions the policy asked for) or decodes to its next block boundary; blocks and snapshots are
published at the commit after each step; a request finishes after its last output token was sampled.

Policies (simplifications in brackets):
- kv-only: prefix caching of attention KV only. Useless for a hybrid model: without the GDN state at the match
  point nothing can be skipped, so its reuse is 0. All non-live memory goes to KV.
- disable-all: the approach the seed replaced (before vllm.rs PR #231): seed capture points, but the first KV
  eviction invalidates every snapshot and turns mamba prefix reuse off for the rest of the run.
- seed: vllm.rs as shipped (#348): KV inserted into the prefix cache only when a sequence finishes; prefix-cache
  capacity 0.65 x KV blocks with trim on insert; snapshots at prefill-chunk ends (8192 tokens), at the prompt end
  and at every decode block boundary, each its own snapshot, usable once the sequence finished; two LRU classes
  (decode snapshots evicted before prefill ones); per-block invalidation on KV eviction; pool = 2 x live slots
  [bounded so that KV keeps at least half of the non-live memory]. Its misaligned prompt-end/finish snapshots are
  counted as if fixed (filed at the floor block with exactly that many tokens).
- sglang: UnifiedRadixCache with extra_buffer: KV published at prefill end and at finish only up to the last
  decode track point (the KV beyond it is freed); one state per extend: the prefill end floored to the block, or
  the branch point instead when the KV match outran the state match; decode tracking every 256 tokens keeping
  only the latest, inserted at finish; states evicted by their own LRU (tombstones: KV kept), KV leaf eviction
  takes its state; a hit refreshes only the consumed state. Memory: --mamba-full-memory-ratio 0.9 gives the state
  pool 0.9/1.9 of the budget, of which 2 rows per running request (live + one track slot, no overlap) are not
  cache [block granularity = page = our block size; no HiCache; chunk ends at 8192 tokens also tracked].
- qnext: the real CacheManager, unmodified: KV published after every step; snapshots at the last boundary before
  the prompt's last token, at the prompt end when aligned, at the branch point, every 8192 prompt tokens, and at the
  last decode boundary (one tracking row per sequence, registered at finish); KV leaves ending a snapshot evicted
  last; snapshots in a segmented LRU (a hit promotes) with superseded prompt-end states demoted at finish. Snapshot
  rows = --qnext-snapshot-fraction of the non-live memory.
- oracle: unbounded memory, a snapshot at every block boundary of every prompt and decode, one request at a time
  (so every request sees all earlier ones): the most any block-granular policy can reuse on this request order.

Reuse = (tokens a cold run computes - tokens computed) / prompt tokens: prompt tokens served from cache (KV and
state), less anything recomputed after a preemption. "gap" = oracle - qnext; it includes the --in-flight requests
that start together at the beginning, before any of them can publish. Policies that keep less memory for KV admit
fewer requests at once, which can raise their reuse on a shared prefix; the replay models that (admission waits for
memory) but reports reuse, not throughput.

    python scripts/bench_prefix_cache.py --plot bench_out/prefix_cache.png --json-out bench_out/prefix_cache.json
    python scripts/bench_prefix_cache.py --trace requests.jsonl --in-flight 16 --budgets 300000,1200000
"""
import argparse
import json
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache import CacheConfig, CacheManager  # noqa: E402

POLICIES = ("kv-only", "disable-all", "seed", "sglang", "qnext", "oracle")


@dataclass(frozen=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]


# ---- peers, modelled on the real manager -----------------------------------------------------------------------------
class SeedManager(CacheManager):
    protect_snapshot_blocks = False
    chunk = 8192
    prefix_cache_ratio = 0.65

    def __init__(self, config):
        super().__init__(config)
        self.blocks.max_cached_blocks = int(self.prefix_cache_ratio * (config.num_blocks - 1))

    def _plan_captures(self, prompt_len, kv_matched_blocks, restored_blocks):
        bs = self.config.block_size
        return sorted({*range(self.chunk, prompt_len, self.chunk), prompt_len // bs * bs} - {0})

    def decode_capture_row(self, seq_id, position):
        seq = self._seq(seq_id)
        row = self.snapshots.reserve() if self.uses_snapshots else None
        if row is not None:
            seq.pending_captures[position] = row
        return row

    def commit(self, seq_id, token_ids, num_computed_tokens):
        self._unpin(self._seq(seq_id))  # nothing is inserted while a sequence runs

    def free(self, seq_id, token_ids, num_computed_tokens, finished):
        seq = self._seq(seq_id)
        if not finished:  # not cached: its KV and snapshots are never inserted
            for row in seq.pending_captures.values():
                self.snapshots.release(row)
            seq.pending_captures.clear()
        super().free(seq_id, token_ids, num_computed_tokens if finished else 0, finished)

    def _snapshot_priority(self, seq, position):
        return 1 if position <= seq.prompt_len else 0  # "preserved" prefill snapshots outlive decode ones

    def _on_restore(self, prefix_hash):
        self.snapshots.touch(prefix_hash)

    def _on_superseded(self, seq):
        pass


class DisableAllManager(SeedManager):
    disabled = False

    def _on_kv_evicted(self, block_ids):
        super()._on_kv_evicted(block_ids)
        if block_ids and not self.disabled:
            self.disabled = True
            self.registry.clear()
            self.snapshots.clear()

    def _resolve(self, hashes, matched):
        return 0 if self.disabled else super()._resolve(hashes, matched)

    def _register(self, seq, position, row):
        if self.disabled:
            self.snapshots.release(row)
        else:
            super()._register(seq, position, row)


class SGLangManager(CacheManager):
    protect_snapshot_blocks = False
    chunk = 8192
    track_interval = 256

    def _plan_captures(self, prompt_len, kv_matched_blocks, restored_blocks):
        bs = self.config.block_size
        if prompt_len - restored_blocks * bs < 64:
            return []  # extends shorter than 64 tokens track nothing
        last = kv_matched_blocks * bs if kv_matched_blocks > restored_blocks else prompt_len // bs * bs
        return sorted({*range(self.chunk, prompt_len, self.chunk), last} - {0})

    def decode_capture_row(self, seq_id, position):
        return None if position % self.track_interval else super().decode_capture_row(seq_id, position)

    def commit(self, seq_id, token_ids, num_computed_tokens):
        seq = self._seq(seq_id)
        if num_computed_tokens <= seq.prompt_len:
            super().commit(seq_id, token_ids, num_computed_tokens)
        else:
            self._unpin(seq)  # decode steps insert nothing

    def _on_restore(self, prefix_hash):
        self.snapshots.touch(prefix_hash)  # one LRU; a hit refreshes only the consumed state

    def _on_superseded(self, seq):
        pass

    def free(self, seq_id, token_ids, num_computed_tokens, finished):
        seq = self._seq(seq_id)
        kept = max(seq.prompt_len, seq.decode_position if seq.decode_row is not None else 0)
        super().free(seq_id, token_ids, min(num_computed_tokens, kept), finished)


class OracleManager(SeedManager):
    protect_snapshot_blocks = True
    prefix_cache_ratio = 1.0
    commit = CacheManager.commit
    free = CacheManager.free
    _on_restore = CacheManager._on_restore

    def _plan_captures(self, prompt_len, kv_matched_blocks, restored_blocks):
        bs = self.config.block_size
        return list(range(bs, prompt_len + 1, bs))


# ---- memory split --------------------------------------------------------------------------------------------------
def build_manager(policy: str, budget: int, args, requests=()) -> CacheManager:
    """Split `budget` KV-token units between KV blocks and snapshot rows by the policy's own rule (the oracle gets
    room for every block and boundary state of `requests`)."""
    bs, r, live = args.block_size, args.snapshot_kv_tokens, args.in_flight
    rest = budget - live * r
    if policy == "oracle":
        blocks = sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in requests) // bs + 2 * len(requests)
        snaps = blocks
    elif policy == "kv-only":
        blocks, snaps = rest // bs, 0
    elif policy in ("seed", "disable-all"):
        snaps = min(2 * live, rest // 2 // r)
        blocks = (rest - snaps * r) // bs
    elif policy == "sglang":
        rows = int(budget * 0.9 / 1.9) // r
        snaps = max(0, rows - 2 * live)
        blocks = (budget - rows * r) // bs
    elif policy == "qnext":
        snaps = int(args.qnext_snapshot_fraction * rest) // r
        blocks = (rest - snaps * r) // bs
    else:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    if blocks < 2:
        raise ValueError(f"budget {budget} leaves {policy} no KV blocks; raise --budgets")
    cls = {"disable-all": DisableAllManager, "seed": SeedManager, "sglang": SGLangManager,
           "oracle": OracleManager}.get(policy, CacheManager)
    return cls(CacheConfig(block_size=bs, num_blocks=blocks + 1, num_live_slots=live, num_snapshot_slots=snaps))


# ---- replay --------------------------------------------------------------------------------------------------------
class _Running:
    __slots__ = ("sid", "tokens", "prompt_len", "final", "computed", "plan")

    def __init__(self, sid, req, adm, plan):
        self.sid = sid
        self.tokens = req.prompt_token_ids + req.output_token_ids
        self.prompt_len = len(req.prompt_token_ids)
        self.final = len(self.tokens) - 1 if req.output_token_ids else self.prompt_len  # last sample never computed
        self.computed = adm.num_cached_tokens
        self.plan = plan


def replay(mgr: CacheManager, requests: list[Request], in_flight: int, chunk: int) -> dict:
    bs = mgr.config.block_size
    waiting = deque(enumerate(requests))
    running: list[_Running] = []
    rejected = preempted = computed = 0
    hold = False  # after a preemption, admit nothing until a request finishes (no thrashing)
    while waiting or running:
        while waiting and len(running) < in_flight and not (hold and running):
            sid, req = waiting[0]
            adm = mgr.admit(sid, req.prompt_token_ids)
            if adm is None:
                if running:
                    break
                rejected += 1  # does not fit even alone
            else:
                running.append(_Running(sid, req, adm, mgr.capture_positions(sid)))
            waiting.popleft()
        progressed = False
        for r in list(running):
            if r.computed < r.prompt_len:
                end = min(r.prompt_len, r.computed + chunk)
                for p in r.plan:
                    if r.computed < p <= end:
                        end = p
                        mgr.reserve_capture(r.sid, p)
                        break
            else:
                end = min(r.final, (r.computed // bs + 1) * bs)
                if not mgr.append_slots(r.sid, end):
                    continue
                if end % bs == 0:
                    mgr.decode_capture_row(r.sid, end)
            computed += end - r.computed
            r.computed = end
            progressed = True
            mgr.commit(r.sid, r.tokens, end)
            if r.computed >= r.final:
                mgr.free(r.sid, r.tokens, r.final, finished=True)
                running.remove(r)
                hold = False
        if not progressed:  # every running request is stuck on memory: preempt the newest and retry it later
            r = running.pop()
            mgr.free(r.sid, r.tokens, r.computed, finished=False)
            if running:
                waiting.appendleft((r.sid, requests[r.sid]))
                preempted += 1
                hold = True
            else:
                rejected += 1  # cannot finish even alone
    # Work saved = what a cold run computes minus what was computed (recomputation after preemption counts as waste).
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    cold = sum(len(r.prompt_token_ids) + max(len(r.output_token_ids) - 1, 0) for r in requests)
    s = mgr.stats
    return {"reuse": (cold - computed) / prompt_tokens, "prompt_tokens": prompt_tokens,
            "reused_tokens": cold - computed,
            "lost_to_missing_state_tokens": s.lost_to_missing_state_tokens,
            "snapshots_captured": s.snapshots_captured, "snapshots_evicted": s.snapshots_evicted,
            "snapshots_invalidated": s.snapshots_invalidated, "kv_blocks": mgr.config.num_blocks - 1,
            "snapshot_rows": mgr.config.num_snapshot_slots, "rejected": rejected, "preempted": preempted}


# ---- workloads -----------------------------------------------------------------------------------------------------
def _toks(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, 150_000) for _ in range(n))


def chat_workload(rng, scale=1.0, users=48, turns=5, system_len=600):
    """Multi-turn chats of many users, rounds interleaved: turn t+1 = turn t's prompt + its answer + a new message."""
    users = max(2, int(users * scale))
    system = _toks(rng, system_len)
    history = [system + _toks(rng, rng.randint(30, 200)) for _ in range(users)]
    out = []
    for _ in range(turns):
        order = list(range(users))
        rng.shuffle(order)
        for u in order:
            answer = _toks(rng, rng.randint(50, 400))
            out.append(Request(history[u], answer))
            history[u] = history[u] + answer + _toks(rng, rng.randint(30, 200))
    return out


def system_prompt_workload(rng, scale=1.0, questions=160, system_len=2000):
    """One shared system prompt followed by many different questions."""
    system = _toks(rng, system_len)
    return [Request(system + _toks(rng, rng.randint(20, 200)), _toks(rng, rng.randint(50, 250)))
            for _ in range(max(4, int(questions * scale)))]


def long_document_workload(rng, scale=1.0, questions=48, doc_len=16000):
    """One long document with many questions about it."""
    doc = _toks(rng, int(doc_len * max(scale, 0.25)))
    return [Request(doc + _toks(rng, rng.randint(20, 120)), _toks(rng, rng.randint(50, 250)))
            for _ in range(max(4, int(questions * scale)))]


def mixed_workload(rng, scale=1.0):
    """Chats, a system prompt and a document at once, interleaved (each stream keeps its own order)."""
    streams = [deque(chat_workload(rng, scale * 0.5, turns=4)), deque(system_prompt_workload(rng, scale * 0.4)),
               deque(long_document_workload(rng, scale * 0.4, doc_len=8000))]
    out = []
    while any(streams):
        s = rng.choice([s for s in streams if s])
        out.append(s.popleft())
    return out


WORKLOADS = {"chat": chat_workload, "system-prompt": system_prompt_workload,
             "long-document": long_document_workload, "mixed": mixed_workload}


def load_trace(path: str) -> list[Request]:
    """One request a line: {"prompt_token_ids": [...], "output_token_ids": [...]}."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                d = json.loads(line)
                if not d.get("prompt_token_ids"):
                    raise ValueError(f"{path}:{i}: prompt_token_ids is missing or empty")
                out.append(Request(tuple(d["prompt_token_ids"]), tuple(d.get("output_token_ids", ()))))
    return out


# ---- driver --------------------------------------------------------------------------------------------------------
def run(args) -> dict:
    if args.trace:
        workloads = {Path(args.trace).stem: load_trace(args.trace)}
    else:
        workloads = {name: WORKLOADS[name](random.Random(args.seed), args.scale) for name in args.workloads}
    results = {"budgets": args.budgets, "policies": list(args.policies), "workloads": {}}
    for name, requests in workloads.items():
        per_budget = {}
        oracle = None
        if "oracle" in args.policies:
            oracle = replay(build_manager("oracle", 0, args, requests), requests, 1, args.chunk)
        for budget in args.budgets:
            row = {}
            for policy in args.policies:
                row[policy] = oracle if policy == "oracle" else replay(build_manager(policy, budget, args), requests,
                                                                        args.in_flight, args.chunk)
            per_budget[str(budget)] = row
        results["workloads"][name] = {"num_requests": len(requests),
                                      "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                                      "budgets": per_budget}
    return results


def ordering_violations(results: dict) -> list[str]:
    """Places where qnext reuses fewer tokens than a non-oracle policy."""
    bad = []
    for name, w in results["workloads"].items():
        for budget, row in w["budgets"].items():
            best = row.get("qnext", {}).get("reused_tokens")
            for policy, r in row.items():
                if best is not None and policy not in ("qnext", "oracle") and r["reused_tokens"] > best:
                    bad.append(f"{name} @ {budget}: {policy} reused {r['reused_tokens']} > qnext "
                               f"{row['qnext']['reused_tokens']}")
    return bad


def format_table(results: dict) -> str:
    policies = results["policies"]
    head = f"{'workload':<15}{'budget':>9} " + "".join(f"{p:>12}" for p in policies)
    if "oracle" in policies and "qnext" in policies:
        head += f"{'gap':>8}"
    lines = [head, "-" * len(head)]
    for name, w in results["workloads"].items():
        for budget, row in w["budgets"].items():
            line = f"{name:<15}{_fmt_tokens(int(budget)):>9} " + "".join(
                f"{100 * row[p]['reuse']:>11.1f}%" for p in policies)
            if "oracle" in row and "qnext" in row:
                line += f"{100 * (row['oracle']['reuse'] - row['qnext']['reuse']):>7.1f}%"
            lines.append(line)
    return "\n".join(lines)


def _fmt_tokens(n: int) -> str:
    return f"{n // 1000}k" if n < 1_000_000 else f"{n / 1e6:g}M"


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        budgets = results["workloads"][name]["budgets"]
        xs = [int(b) for b in budgets]
        for policy in results["policies"]:
            ys = [100 * budgets[b][policy]["reuse"] for b in budgets]
            ax.plot(xs, ys, marker="o", label=policy, linestyle="--" if policy == "oracle" else "-")
        ax.set_xscale("log")
        ax.set_xticks(xs, [_fmt_tokens(x) for x in xs])
        ax.minorticks_off()
        ax.set_title(name)
        ax.set_xlabel("memory budget (KV tokens)")
        ax.set_ylim(min(0, ax.get_ylim()[0]), 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("prompt tokens reused (%)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--trace", help="JSONL trace replayed instead of the built-in workloads")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--budgets", type=lambda s: [int(float(x)) for x in s.split(",")],
                   default=[150_000, 300_000, 600_000, 1_200_000],
                   help="total memory budgets in KV tokens, comma separated")
    p.add_argument("--snapshot-kv-tokens", type=int, default=3000,
                   help="memory of one state row in KV tokens (Qwen3-Next-80B: ~3000)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--in-flight", type=int, default=8, help="requests running at once")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk in tokens")
    p.add_argument("--qnext-snapshot-fraction", type=float, default=0.5,
                   help="share of the non-live memory qnext gives to snapshot rows")
    p.add_argument("--scale", type=float, default=1.0, help="workload size multiplier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    p.add_argument("--plot", help="PNG path for reuse vs budget")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    results = run(args)
    results["seconds"] = round(time.perf_counter() - t0, 2)
    results["args"] = {k: v for k, v in vars(args).items()}
    print(format_table(results))
    bad = ordering_violations(results)
    print(f"\n{results['seconds']} s; " + ("qnext reuses at least as much as every non-oracle policy everywhere"
                                          if not bad else "qnext loses: " + "; ".join(bad)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
