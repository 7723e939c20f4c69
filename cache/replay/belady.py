"""A clairvoyant bounded cache ("belady"): Belady's MIN adapted to a hybrid model's KV chains and snapshots, with
the same memory as qnext's manager at a budget, on a request order known in advance.

The setting is the oracle's (cache/replay/peers.py): requests one at a time in trace order, a snapshot possible at
every block boundary a request computes. Memory is qnext's: the budget less `in_flight` live state rows (what
`plan_cache` reserves for them), shared by KV blocks (`block_size` tokens each) and snapshot rows
(`state_kv_tokens` each) in any mix, changing at will: every fixed split qnext's sizing could choose is one case.

A reuse is a unit: request b can skip the tokens up to depth d only if blocks 1..d of its chain and the snapshot at
d are resident when it is admitted. The unit each later request wants (its plan) is the deepest one an earlier
request has, d = D_b (the oracle's reuse), made by the last request before b that computed that block (the plan's
start: every request containing a block refreshes it). Eviction, when a running request's blocks or a new
snapshot need room: first what no plan needs (least recently touched, shallow blocks kept longest: they serve
shallower matches), then the plan whose request comes farthest in the future, whose items no other plan shares go.
A request reuses the deepest resident unit up to D_b, a plan's or a leftover's.

Where it is only approximately optimal: Belady's MIN is optimal for items of one size and one value; here units
differ in bytes (a snapshot is 3000 tokens, a KV block 64; plans share blocks) and in what they save, so dropping the
farthest plan first can lose to keeping two small units instead of one large one (offline caching with sizes is
NP-hard). So belady is a feasible clairvoyant schedule, a lower bound on the best offline reuse, not an upper bound.
The upper bound is `reuse_bound` (cache/replay/reuse_bound.py), a relaxation of the same model solved by duality;
belady <= bound always, and where the two meet the optimum is known.
"""
import heapq
from bisect import bisect_right
from dataclasses import dataclass

from cache.hashing import block_hashes
from cache.replay.workloads import Request


@dataclass(frozen=True)
class TraceFacts:
    """What the trace says, request by request (b = index in the trace).
    chains[b]: the chain hashes of the full blocks b computes (prompt and output, the last sample never computed);
    own_blocks[b]: the KV blocks b holds while it runs (its partial last block too);
    depth[b]: D_b, the blocks of b's prompt an earlier request computed (at most the last prompt token's block);
    last_touch[b][k]: the last request before b whose chain holds b's block k (k < depth[b])."""
    chains: list[list[bytes]]
    own_blocks: list[int]
    depth: list[int]
    last_touch: list[list[int]]
    prompt_tokens: int


def trace_facts(requests: list[Request], block_size: int) -> TraceFacts:
    chains, own, depth, touches = [], [], [], []
    last: dict[bytes, int] = {}
    for b, q in enumerate(requests):
        tokens = q.prompt_token_ids + q.output_token_ids
        final = len(tokens) - 1 if q.output_token_ids else len(q.prompt_token_ids)
        chain = block_hashes(tokens, block_size)[:final // block_size]
        cap = (len(q.prompt_token_ids) - 1) // block_size
        d = next((k for k, h in enumerate(chain[:cap]) if h not in last), min(cap, len(chain)))
        chains.append(chain)
        own.append(-(-final // block_size))
        depth.append(d)
        touches.append([last[h] for h in chain[:d]])
        last.update((h, b) for h in chain)
    return TraceFacts(chains, own, depth, touches, sum(len(q.prompt_token_ids) for q in requests))


def cache_memory(budget: int, in_flight: int, state_kv_tokens: int, block_size: int) -> int:
    """KV tokens left for KV blocks and snapshot rows once qnext's live rows are taken (cache/sizing.py)."""
    memory = budget - in_flight * state_kv_tokens
    if memory < block_size:
        raise ValueError(f"budget {budget} leaves {memory} tokens after {in_flight} live rows of "
                         f"{state_kv_tokens}; raise the budget")
    return memory


def belady_reuse(facts: TraceFacts, memory: int, block_size: int, state_kv_tokens: int) -> dict:
    """Replay the trace under the clairvoyant policy in `memory` KV tokens (module docstring)."""
    bs, r = block_size, state_kv_tokens
    plans_from: dict[int, list[int]] = {}
    uses: dict[bytes, list[int]] = {}           # hash -> the requests whose reusable prefix holds it, in order
    points: dict[bytes, int] = {}               # plan point -> the plans that end there
    for b, d in enumerate(facts.depth):
        if d:
            plans_from.setdefault(facts.last_touch[b][d - 1], []).append(b)
            points[facts.chains[b][d - 1]] = points.get(facts.chains[b][d - 1], 0) + 1
        for h in facts.chains[b][:d]:
            uses.setdefault(h, []).append(b)
    shared = {("snap", h) for h, n in points.items() if n > 1}   # a system prompt's or a document's end
    shared |= {("kv", h) for b, d in enumerate(facts.depth) if d and ("snap", facts.chains[b][d - 1]) in shared
               for h in facts.chains[b][:d]}
    kv: set[bytes] = set()
    snaps: set[bytes] = set()
    depth_of: dict[bytes, int] = {}
    unplanned: dict[tuple, float] = {}          # resident items no kept plan needs -> their next possible use
    heap: list = []                             # (-next use, snapshots first, deeper first, n, item); lazy
    refs: dict[tuple, int] = {}                 # item -> kept plans that need it
    kept: set[int] = set()
    held = reused = dropped = 0

    def items(b: int) -> list[tuple]:
        d = facts.depth[b]
        return [("kv", h) for h in facts.chains[b][:d]] + [("snap", facts.chains[b][d - 1])]

    def leave_unplanned(item: tuple, now: int) -> None:
        """A leftover's next use: the next request that can reuse it, if it serves several (a snapshot that ended
        one plan only is superseded by that request's own end; KV blocks serve through such snapshots)."""
        later = uses.get(item[1], ()) if item in shared else ()
        i = bisect_right(later, now)
        nxt = later[i] if i < len(later) else float("inf")
        unplanned[item] = nxt
        heapq.heappush(heap, (-nxt, item[0] == "kv", -depth_of[item[1]], len(heap), item))

    def release(b: int, now: int) -> None:
        kept.discard(b)
        for item in items(b):
            refs[item] -= 1
            if not refs[item]:
                del refs[item]
                leave_unplanned(item, now)

    def make_room(limit: int, now: int) -> bool:
        """Evict whatever is next used farthest away: a leftover, or the farthest kept plan's unit."""
        nonlocal held, dropped
        while held > limit:
            while heap and unplanned.get(heap[0][-1]) != -heap[0][0]:
                heapq.heappop(heap)             # stale: planned again or touched since
            if heap and (not kept or -heap[0][0] >= max(kept)):
                item = heapq.heappop(heap)[-1]
                del unplanned[item]
                (kv if item[0] == "kv" else snaps).discard(item[1])
                held -= bs if item[0] == "kv" else r
            elif kept:
                release(max(kept), now)
                dropped += 1
            else:
                return False
        return True

    for t, chain in enumerate(facts.chains):
        d = facts.depth[t]
        k = next((i for i, h in enumerate(chain[:d]) if h not in kv), d)
        got = max((i + 1 for i in range(k) if chain[i] in snaps), default=0)
        reused += got * bs
        if t in kept:
            release(t, t)
        for i, h in enumerate(chain):           # pinned while t runs
            depth_of[h] = i
            unplanned.pop(("kv", h), None)
        new_blocks = facts.own_blocks[t] - sum(h in kv for h in chain)
        if not make_room(memory - new_blocks * bs, t):
            raise ValueError(f"request {t} needs {facts.own_blocks[t] * bs} tokens of KV alone; the cache has "
                             f"{memory}")
        held += bs * sum(h not in kv for h in chain)
        kv.update(chain)
        for b in plans_from.get(t, ()):
            point = chain[facts.depth[b] - 1]
            if point not in snaps:
                if facts.depth[b] <= got:       # t restored at or past it: the state there was never computed
                    continue
                snaps.add(point)
                held += r
            for item in items(b):
                refs[item] = refs.get(item, 0) + 1
                unplanned.pop(item, None)
            kept.add(b)
        for item in [("kv", h) for h in chain] + [("snap", h) for h in chain if h in snaps]:
            if item not in refs:
                leave_unplanned(item, t)
        make_room(memory, t)
    return {"reuse": reused / facts.prompt_tokens, "reused_tokens": reused, "prompt_tokens": facts.prompt_tokens,
            "plans_dropped": dropped, "memory": memory}
