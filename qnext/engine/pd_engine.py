"""The prefill/decode disaggregation ends of an engine (docs/pd.md): a prefill request stops after its first token
and leaves a bundle (KV blocks and the state at the last prompt token); a transferred request keeps the leading
blocks this engine's cache holds, fetches the rest and the state, and decodes from the first token on.

An object the LLMEngine holds (`engine.pd`), with its own state (the bundles waiting for decode engines, the
prompts just computed for export); it reaches the engine only through what it is given: the intake, the cache, the
engine's request table (`admit` a sequence, `check_new` an id), its stats and its model identity."""
from __future__ import annotations

from typing import Callable

from qnext.config import ModelConfig
from qnext.engine.engine_cache import EngineCache
from qnext.engine.intake import Prompt, RequestIntake
from qnext.engine.pd_features import ExportPrefillFeature, TransferredPromptFeature
from qnext.engine.pd_requests import PendingTransfer, PrefillExports, begin_transfer, finish_transfer
from qnext.engine.pd_transfer import BundleSource, PrefillBundle
from qnext.engine.sampled_token import SampledToken
from qnext.engine.sequence import Sequence
from qnext.engine.stats import EngineStats
from qnext.sampling_params import SamplingParams


class PrefillDecodeEnds:
    def __init__(self, cfg: ModelConfig, tp: int, block_size: int, kv_cache_scale: float, max_model_len: int, *,
                 intake: RequestIntake, cache: EngineCache, stats: EngineStats, eos_token_ids,
                 admit: Callable[[Sequence], None], check_new: Callable[[str], None],
                 model_identity: Callable[[], str]):
        """admit(seq): the engine takes a sequence built here (its request table and scheduler); check_new(id):
        ValueError / RuntimeError when the engine cannot take a request of that id (in use, engine closed)."""
        self.cfg, self.tp, self.max_model_len, self.eos_token_ids = cfg, tp, max_model_len, tuple(eos_token_ids)
        self.intake, self.cache, self.stats = intake, cache, stats
        self._admit, self._check_new, self.model_identity = admit, check_new, model_identity
        self.exports = PrefillExports(cfg, tp, block_size, kv_cache_scale, model_identity)
        self._prefilled: list[tuple[Sequence, list[int], int, SampledToken]] = []   # ExportPrefillFeature's outbox

    # ---- the prefill end -------------------------------------------------------------------------------------------
    def add_prefill_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """A request this engine prefills for a decode engine: it stops after its first token (finish_reason
        "prefilled") and leaves a PrefillBundle for `take_prefill_bundle`; a first token that really ends it (the
        request's own stop, max_tokens) ends it here, and nothing is exported."""
        self._check_new(request_id)
        seq = self.intake.samples(request_id, prompt, params or SamplingParams())[0]
        if seq.group is not None or seq.visuals is not None:
            raise ValueError("prefill/decode disaggregation takes text prompts with n=1")
        seq.features.append(ExportPrefillFeature(self._prefilled))
        self._admit(seq)

    def export_prefilled(self) -> None:
        """The bundles of the prompts the last step computed, read out of the buffers: right after the step's
        postprocess, before anything else writes their freed blocks or row."""
        if self._prefilled:
            prefilled = list(self._prefilled)
            self._prefilled.clear()              # in place: the requests' ExportPrefillFeatures hold this list
            self.exports.export(prefilled, self.cache.manager)

    def take_prefill_bundle(self, request_id: str) -> PrefillBundle | None:
        """The bundle of a prefill request whose prompt has run (None: not yet, or already taken)."""
        return self.exports.take(request_id)

    # ---- the decode end --------------------------------------------------------------------------------------------
    def add_transferred_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None,
                                source: BundleSource) -> None:
        """A request whose prompt a prefill engine computed (source: its bundle, or a fetcher of it): this engine
        keeps the leading blocks its own cache holds, fetches only the rest and the state at the last prompt token,
        and decodes from the first token on (docs/pd.md). The three steps apart, for a caller that fetches on
        another thread: begin_transferred_request, PendingTransfer.fetch, finish_transferred_request."""
        pending = self.begin_transferred_request(request_id, prompt, params, source.meta)
        try:
            pending.fetch(source)
        except BaseException:
            self.cancel_transferred_request(pending)
            raise
        self.finish_transferred_request(pending)

    def begin_transferred_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None,
                                  meta: dict) -> PendingTransfer:
        self._check_new(request_id)
        seq = self.intake.samples(request_id, prompt, params or SamplingParams())[0]
        return begin_transfer(seq, meta, self.cache, self.cfg, self.tp,
                              self.exports.layout(self.cache.manager.buffers), self.model_identity(),
                              self.eos_token_ids, self.max_model_len)

    def finish_transferred_request(self, pending: PendingTransfer) -> None:
        seq = finish_transfer(pending, self.cache)
        try:
            self._check_new(seq.request_id)
        except (ValueError, RuntimeError):
            self.cache.manager.transferred.drop(seq.request_id)
            raise
        transferred = pending.staged
        seq.features.append(TransferredPromptFeature(transferred, len(seq.prompt_token_ids)))
        self._admit(seq)
        self.stats.num_transferred_requests += 1
        self.stats.transfer_bytes += transferred.bytes_moved
        self.stats.transfer_min_bytes += transferred.min_bytes
        self.stats.transfer_seconds += pending.seconds

    def cancel_transferred_request(self, pending: PendingTransfer) -> None:
        """Releases what begin_transferred_request held (its fetch failed, or the request was aborted)."""
        self.cache.manager.transferred.drop(pending.seq.request_id)
