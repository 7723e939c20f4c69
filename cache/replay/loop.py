"""The engine loop, replayed on the host: the real CacheManager, model compute replaced by token accounting.

Up to `in_flight` requests run at once, admitted in trace order (head-of-line blocking when one does not fit; a
request whose prefix a running one is still computing waits for it: CacheManager.sibling_prefix);
every step each running request either prefills one chunk (`chunk` tokens, cut at the capture positions the
manager asked for) or decodes to its next block boundary; what a step wrote is committed after it; a request is
freed after its last output token was sampled. Deterministic, and seconds for thousands of requests.

Where reuse is lost, per admission, against what an oracle could reuse there (the longest block prefix that a
request admitted earlier has, prompt or output, capped at the last prompt token): `concurrent` - not computed yet
by any request when this one was admitted (requests that start together before any has published), `evicted_kv` -
computed but its KV was no longer cached, `missing_state` - KV matched but no snapshot at or near its end (the
match is trimmed back to the deepest snapshot), `preempted` - recomputed after a preemption.
"""
from collections import deque

from cache.hashing import block_hashes
from cache.manager import Admission, CacheManager
from cache.replay.workloads import Request


class _Running:
    __slots__ = ("sid", "tokens", "prompt_len", "final", "computed")

    def __init__(self, sid: int, req: Request, adm: Admission):
        self.sid = sid
        self.tokens = req.prompt_token_ids + req.output_token_ids
        self.prompt_len = len(req.prompt_token_ids)
        self.final = len(self.tokens) - 1 if req.output_token_ids else self.prompt_len  # last sample never computed
        self.computed = adm.num_cached_tokens


def replay(mgr: CacheManager, requests: list[Request], in_flight: int, chunk: int) -> dict:
    """Run `requests` through `mgr`. Reuse = (tokens a cold run computes - tokens computed) / prompt tokens: prompt
    tokens served from cache, less anything recomputed after a preemption. Steps: engine steps the run took (fewer
    requests admitted at once, for want of KV blocks, take more)."""
    bs = mgr.config.block_size
    waiting = deque(enumerate(requests))
    running: list[_Running] = []
    rejected = preempted = computed = steps = 0
    loss = {"concurrent": 0, "evicted_kv": 0, "missing_state": 0, "preempted": 0}
    hashes = {}
    seen: set[bytes] = set()        # blocks of every request admitted so far (what an oracle would hold)
    written: set[bytes] = set()     # blocks some step has computed so far
    hold = False  # after a preemption, admit nothing until a request finishes (no thrashing)
    while waiting or running:
        i = 0
        while i < len(waiting) and len(running) < in_flight and not (hold and running):
            sid, req = waiting[i]
            if mgr.sibling_prefix(req.prompt_token_ids) is not None:
                i += 1  # held back until a running request has computed the prefix they share
                continue
            adm = mgr.admit(sid, req.prompt_token_ids)
            if adm is None:
                if running:
                    break
                rejected += 1  # does not fit even alone
            else:
                running.append(_Running(sid, req, adm))
                _count_loss(loss, hashes, seen, written, sid, req, adm, bs)
            del waiting[i]
        progressed = False
        steps += 1
        for r in list(running):
            if r.computed < r.prompt_len:
                end = min(r.prompt_len, r.computed + chunk)
                for p in mgr.capture_positions(r.sid):
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
            written.update(hashes[r.sid][r.computed // bs:end // bs])
            r.computed = end
            progressed = True
            mgr.commit(r.sid, r.tokens, end)
            if r.computed >= r.final:
                mgr.free(r.sid, r.tokens, r.final)
                running.remove(r)
                hold = False
        mgr.take_transfers()  # the copies between tiers a real engine would run before the next step
        if not progressed:  # every running request is stuck on memory: preempt the newest and retry it later
            r = running.pop()
            mgr.free(r.sid, r.tokens, r.computed)
            if running:
                waiting.appendleft((r.sid, requests[r.sid]))
                preempted += 1
                loss["preempted"] += r.computed
                hold = True
            else:
                rejected += 1  # cannot finish even alone
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    cold = sum(len(r.prompt_token_ids) + max(len(r.output_token_ids) - 1, 0) for r in requests)
    s = mgr.stats
    return {"reuse": (cold - computed) / prompt_tokens, "prompt_tokens": prompt_tokens,
            "reused_tokens": cold - computed, "lost": loss,
            "lost_to_missing_state_tokens": s.lost_to_missing_state_tokens,
            "snapshots_captured": s.snapshots_captured, "snapshots_evicted": s.snapshots_evicted,
            "snapshots_invalidated": s.snapshots_invalidated, "kv_blocks": mgr.config.num_blocks - 1,
            "snapshot_rows": mgr.config.num_snapshot_slots, "rejected": rejected, "preempted": preempted,
            "steps": steps, "host_blocks": mgr.config.num_host_blocks,
            "host_snapshot_rows": mgr.config.num_host_snapshot_slots,
            "host_hit_tokens": s.tiers.host_hit_tokens, "blocks_offloaded": s.tiers.blocks_offloaded,
            "blocks_loaded": s.tiers.blocks_loaded, "snapshots_loaded": s.tiers.snapshots_loaded}


def _count_loss(loss: dict, hashes: dict, seen: set, written: set, sid: int, req: Request, adm: Admission,
                bs: int) -> None:
    """Splits what an oracle could reuse at this admission and the cache did not serve (module docstring)."""
    if sid in hashes:               # re-admitted after a preemption: counted as preempted
        return
    hashes[sid] = block_hashes(req.prompt_token_ids + req.output_token_ids, bs)
    own = hashes[sid][:(len(req.prompt_token_ids) - 1) // bs]
    reachable = next((i for i, h in enumerate(own) if h not in seen), len(own)) * bs
    published = next((i for i, h in enumerate(own) if h not in written), len(own)) * bs
    kv = min(adm.kv_matched_tokens, published)
    loss["concurrent"] += reachable - published
    loss["evicted_kv"] += max(0, published - kv)
    loss["missing_state"] += max(0, kv - adm.num_cached_tokens)
    seen.update(hashes[sid])
