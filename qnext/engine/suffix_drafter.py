"""Suffix and n-gram drafting behind the runner's drafter seam (docs/speculative.md, "Suffix and n-gram drafting"):
drafts come from the text on the host (suffix_cache.SuffixCache), a number per row per step of the index's choosing
(0 to k), and the target verifies them in one window (host_drafter.py, draft_verify.py) with the same exact state
rollback as MTP. No head runs and the cache holds no extra KV layer. A grammar row that its grammar forces drafts
the forced tokens instead (grammar fast-forward, host_drafter.py)."""
from __future__ import annotations

from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.draft_gate import AcceptanceGate
from qnext.engine.host_drafter import HostDrafter
from qnext.engine.plan import StepPlan
from qnext.engine.suffix_cache import SuffixCache


class SuffixDrafter(HostDrafter):
    def __init__(self, cfg: ModelConfig, config: EngineConfig, gate: AcceptanceGate | None = None):
        super().__init__(cfg, config)
        self.options = o = config.host_drafting
        if o.method == "suffix":
            self.cache = SuffixCache(o.max_cached_requests)
        else:                                   # ngram: the request's own text only, keyed by its shortest match
            self.cache = SuffixCache(0, key_lengths=(o.prompt_lookup_min,))
        self.gate = gate if gate is not None else AcceptanceGate()

    def observe(self, plan: StepPlan, i: int, new: list[int]) -> None:
        """Indexes the row's new tokens; a verify step of text drafts counts toward the row's acceptance gate
        (forced drafts do not: they say nothing about how well the text predicts)."""
        seq, rid = plan.items[i].seq, plan.items[i].seq.request_id
        if plan.speculative and not self.drafts_were_forced(rid):
            self.gate.record(rid, drafted=plan.multi.steps[i] - 1, kept=len(new) - 1)
        self.cache.update(rid, seq.prompt_token_ids, seq.output_token_ids + new)

    def text_drafts(self, request_id: str, room: int) -> list[int]:
        if not self.gate.allows(request_id):
            return []
        return self._draft(request_id, room) if room > 0 else []

    def _draft(self, request_id: str, num_tokens: int) -> list[int]:
        o = self.options
        if o.method == "suffix":
            return self.cache.speculate(request_id, num_tokens, o.max_spec_factor, o.min_token_prob,
                                        o.max_tree_depth).tokens
        context = self.cache.context(request_id)
        return self.cache.local[request_id].lookup(context, num_tokens, o.prompt_lookup_min, o.prompt_lookup_max)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.cache.free(request_id)
        self.gate.free(request_id)


def host_drafter(cfg: ModelConfig, config: EngineConfig) -> HostDrafter | None:
    """The engine's host drafter: suffix / ngram drafting for such a speculative_config, grammar fast-forward alone
    without any, None with an MTP head or where windows do not run (config.max_draft_tokens)."""
    if config.host_drafting is not None:
        return SuffixDrafter(cfg, config)
    if config.speculative_config is None and config.max_draft_tokens:
        return HostDrafter(cfg, config)
    return None
