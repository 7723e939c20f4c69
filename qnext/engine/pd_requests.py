"""The engine's two ends of prefill/decode disaggregation (docs/scale.md): the prefill side's exports after the step
that ran a prompt, and the decode side's intake of a request whose prompt was computed elsewhere."""
from __future__ import annotations

import threading
import time

from cache import CacheManager
from cache.hashing import block_hashes
from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.engine.engine_cache import EngineCache
from qnext.engine.pd_transfer import (BundleSource, PrefillBundle, cache_layout_meta, check_layouts, export_prefill,
                                      first_token, stage_transferred)
from qnext.engine.postprocess import append_sampled
from qnext.engine.sequence import Sequence


class PrefillExports:
    """The bundles of a prefill engine's requests, from the step that ran their prompts until they are taken
    (any thread may take one); a bundle nobody took within `ttl_s` is dropped at the next export."""

    def __init__(self, cfg: ModelConfig, tp: int, block_size: int, kv_cache_scale: float, ttl_s: float = 300.0):
        self.cfg, self.tp, self.block_size, self.kv_cache_scale = cfg, tp, block_size, float(kv_cache_scale)
        self.ttl_s = ttl_s
        self._bundles: dict[str, tuple[float, PrefillBundle]] = {}
        self._lock = threading.Lock()

    def layout(self, buffers: CacheBuffers) -> dict:
        return cache_layout_meta(self.cfg, buffers, self.block_size, self.kv_cache_scale)

    def export(self, scheduler, manager: CacheManager) -> None:
        """Reads the prompts the last step ran for export (scheduler.prefilled) out of the buffers: right after
        the step's postprocess, before anything else writes their freed blocks or row."""
        if not scheduler.prefilled:
            return
        buffers = manager.buffers
        layout = self.layout(buffers)
        now = time.monotonic()
        bundles = {seq.request_id: (now, export_prefill(
            buffers, self.cfg, self.tp, layout, seq.request_id, seq.prompt_token_ids,
            block_hashes(seq.prompt_token_ids, self.block_size, manager.block_hash_fn), table, row, token,
            (seq.finish_reason, seq.stop_reason))) for seq, table, row, token in scheduler.prefilled}
        scheduler.prefilled = []
        with self._lock:
            self._bundles = {rid: b for rid, b in self._bundles.items() if now - b[0] < self.ttl_s}
            self._bundles.update(bundles)

    def get(self, request_id: str) -> PrefillBundle | None:
        with self._lock:
            entry = self._bundles.get(request_id)
        return None if entry is None else entry[1]

    def take(self, request_id: str) -> PrefillBundle | None:
        with self._lock:
            entry = self._bundles.pop(request_id, None)
        return None if entry is None else entry[1]


def transferred_sequence(seq: Sequence, source: BundleSource, cache: EngineCache, cfg: ModelConfig, tp: int,
                         layout: dict, eos_token_ids, max_model_len: int) -> None:
    """Makes `seq` (fresh from intake, n=1) a request whose prompt was computed elsewhere: checks the bundle
    against it, holds the leading blocks this cache has, fetches the rest and the state, appends the first token
    (its stop check, detokenizer, grammar and logprobs as if sampled here)."""
    meta = source.meta
    if seq.group is not None or seq.visuals is not None:
        raise ValueError("prefill/decode disaggregation takes text prompts with n=1")
    if list(meta["prompt_token_ids"]) != seq.prompt_token_ids:
        raise ValueError(f"the prefill engine's prompt ({len(meta['prompt_token_ids'])} tokens) is not this "
                         f"request's ({len(seq.prompt_token_ids)} tokens): send both the same request")
    if meta["finish_reason"] != "prefilled":
        raise ValueError(f"the prefill engine finished this request ({meta['finish_reason']}): nothing to decode")
    check_layouts(meta["layout"], layout)
    manager = cache.manager
    held = manager.hold_prefix(seq.request_id, seq.prompt_token_ids)
    try:
        staged = stage_transferred(source, held, manager.buffers, cfg, tp)
        stop = append_sampled(seq, first_token(meta), eos_token_ids, max_model_len)
        if stop is not None:
            raise ValueError(f"the first token ends this request here ({stop}) but not on the prefill engine: "
                             "both sides must get the same sampling params")
    except BaseException:
        manager.drop_held(seq.request_id)
        raise
    seq.transferred = staged
