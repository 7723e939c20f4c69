"""The prefill/decode disaggregation ends of LLMEngine (docs/pd.md), as a mixin: a prefill request stops after
its first token and leaves a bundle (KV blocks and the state at the last prompt token); a transferred request keeps
the leading blocks this engine's cache holds, fetches the rest and the state, and decodes from the first token on.
The engine's attributes they use: requests, intake, cache, scheduler, stats, model_config, config, max_model_len,
prefill_exports, model_identity, _closed, abort_request, release."""
from __future__ import annotations

from qnext.engine.intake import Prompt
from qnext.engine.pd_requests import PendingTransfer, begin_transfer, finish_transfer
from qnext.engine.pd_transfer import BundleSource, PrefillBundle
from qnext.sampling_params import SamplingParams


class PrefillDecodeEnds:
    def add_prefill_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """A request this engine prefills for a decode engine: it stops after its first token (finish_reason
        "prefilled") and leaves a PrefillBundle for `take_prefill_bundle`; a first token that really ends it (the
        request's own stop, max_tokens) ends it here, and nothing is exported."""
        self.add_request(request_id, prompt, params)
        seq = self.requests[request_id]
        if seq.group is not None or seq.visuals is not None:
            self.abort_request(request_id)
            self.release(request_id)
            raise ValueError("prefill/decode disaggregation takes text prompts with n=1")
        seq.export_prefill = True

    def take_prefill_bundle(self, request_id: str) -> PrefillBundle | None:
        """The bundle of a prefill request whose prompt has run (None: not yet, or already taken)."""
        return self.prefill_exports.take(request_id)

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
        if self._closed:
            raise RuntimeError("the engine is closed")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self.intake.samples(request_id, prompt, params or SamplingParams())[0]
        return begin_transfer(seq, meta, self.cache, self.model_config, self.config.tensor_parallel_size,
                              self.prefill_exports.layout(self.cache.manager.buffers), self.model_identity(),
                              self.scheduler.eos_token_ids, self.max_model_len)

    def finish_transferred_request(self, pending: PendingTransfer) -> None:
        seq = finish_transfer(pending, self.cache)
        if seq.request_id in self.requests:
            self.cache.manager.drop_held(seq.request_id)
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(seq.prompt_token_ids)
        self.stats.num_transferred_requests += 1
        self.stats.transfer_bytes += seq.transferred.bytes_moved
        self.stats.transfer_min_bytes += seq.transferred.min_bytes
        self.stats.transfer_seconds += pending.seconds

    def cancel_transferred_request(self, pending: PendingTransfer) -> None:
        """Releases what begin_transferred_request held (its fetch failed, or the request was aborted)."""
        self.cache.manager.drop_held(pending.seq.request_id)
