"""The engine loop, replayed on the host: the real CacheManager, model compute replaced by token accounting.

Up to `in_flight` requests run at once, admitted in trace order (head-of-line blocking when one does not fit);
every step each running request either prefills one chunk (`chunk` tokens, cut at the capture positions the
manager asked for) or decodes to its next block boundary; what a step wrote is committed after it; a request is
freed after its last output token was sampled. Deterministic, and seconds for thousands of requests.
"""
from collections import deque

from cache.manager import Admission, CacheManager
from cache.replay.workloads import Request


class _Running:
    __slots__ = ("sid", "tokens", "prompt_len", "final", "computed", "plan")

    def __init__(self, sid: int, req: Request, adm: Admission, plan: list[int]):
        self.sid = sid
        self.tokens = req.prompt_token_ids + req.output_token_ids
        self.prompt_len = len(req.prompt_token_ids)
        self.final = len(self.tokens) - 1 if req.output_token_ids else self.prompt_len  # last sample never computed
        self.computed = adm.num_cached_tokens
        self.plan = plan


def replay(mgr: CacheManager, requests: list[Request], in_flight: int, chunk: int) -> dict:
    """Run `requests` through `mgr`. Reuse = (tokens a cold run computes - tokens computed) / prompt tokens: prompt
    tokens served from cache, less anything recomputed after a preemption. Steps: engine steps the run took (fewer
    requests admitted at once, for want of KV blocks, take more)."""
    bs = mgr.config.block_size
    waiting = deque(enumerate(requests))
    running: list[_Running] = []
    rejected = preempted = computed = steps = 0
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
        steps += 1
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
                hold = True
            else:
                rejected += 1  # cannot finish even alone
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    cold = sum(len(r.prompt_token_ids) + max(len(r.output_token_ids) - 1, 0) for r in requests)
    s = mgr.stats
    return {"reuse": (cold - computed) / prompt_tokens, "prompt_tokens": prompt_tokens,
            "reused_tokens": cold - computed,
            "lost_to_missing_state_tokens": s.lost_to_missing_state_tokens,
            "snapshots_captured": s.snapshots_captured, "snapshots_evicted": s.snapshots_evicted,
            "snapshots_invalidated": s.snapshots_invalidated, "kv_blocks": mgr.config.num_blocks - 1,
            "snapshot_rows": mgr.config.num_snapshot_slots, "rejected": rejected, "preempted": preempted,
            "steps": steps, "host_blocks": mgr.config.num_host_blocks,
            "host_snapshot_rows": mgr.config.num_host_snapshot_slots,
            "host_hit_tokens": s.tiers.host_hit_tokens, "blocks_offloaded": s.tiers.blocks_offloaded,
            "blocks_loaded": s.tiers.blocks_loaded, "snapshots_loaded": s.tiers.snapshots_loaded}
