"""The engine as a PD server's engine loop sees it (server/pd_serving.py): add_request reads the request's PD role
from its prompt's "pd" entry (a PDRequest, put there by Admission from the x-qnext-pd header)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import TYPE_CHECKING

from qnext.engine.pd_requests import PrefillExports
from qnext.engine.pd_transfer import PeerMismatchError
from qnext.served_engine import EngineSnapshot, ForwardingEngine
from qnext.server.engine_errors import RequestError
from qnext.server.pd_options import PDOptions

if TYPE_CHECKING:
    from qnext.engine.llm_engine import LLMEngine

logger = logging.getLogger("qnext.server")


class PrefillRoleEngine(ForwardingEngine):
    """A request from the router (with the header) is prefilled and its bundle exported; any other is served whole.
    `exports`: the bundles waiting for decode servers (the /pd/bundles routes serve them)."""

    def __init__(self, engine: LLMEngine, options: PDOptions):
        super().__init__(engine)
        self.exports: PrefillExports = engine.pd.exports
        self.exports.limit(options.bundle_ttl_s, options.max_bundle_bytes)

    def add_request(self, request_id, prompt, params=None):
        pd = prompt.pop("pd", None) if isinstance(prompt, dict) else None
        if pd is None:
            return self.inner.add_request(request_id, prompt, params)
        self.inner.pd.add_prefill_request(request_id, prompt, params)


class DecodeRoleEngine(ForwardingEngine):
    """A request with a prefill source: its checks and hold on the engine thread (a refusal there is the request's
    admission error), its fetch on a worker thread (the engine keeps stepping meanwhile), its admission on the engine
    thread once the arrays are here (`step`). A transfer that fails fails that request alone, with the status it
    means (`take_failed_requests`, read by the engine loop after each step); the step and its neighbours go on."""

    def __init__(self, engine: LLMEngine, max_fetches: int = 4):
        super().__init__(engine)
        self._fetches = concurrent.futures.ThreadPoolExecutor(max_fetches, thread_name_prefix="qnext-pd-fetch")
        self._pending: dict[str, tuple] = {}     # request id -> (PendingTransfer, future, prefill url)
        self._failed: list[tuple[str, RequestError]] = []

    def add_request(self, request_id, prompt, params=None):
        pd = prompt.pop("pd", None) if isinstance(prompt, dict) else None
        if pd is None or pd.source is None:
            return self.inner.add_request(request_id, prompt, params)
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            pending = self.inner.pd.begin_transferred_request(request_id, prompt, params, pd.source.meta)
        except PeerMismatchError as e:
            raise RequestError(f"{e} (prefill server {pd.prefill_url})", 502) from None
        self._pending[request_id] = (pending, self._fetches.submit(pending.fetch, pd.source), pd.prefill_url)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.inner.has_unfinished_requests()

    def status(self) -> EngineSnapshot:
        """Requests still fetching count as waiting."""
        snap = self.inner.status()
        return dataclasses.replace(snap, num_waiting=snap.num_waiting + len(self._pending))

    def step(self):
        if self._pending and not self.inner.has_unfinished_requests():     # only fetches: wait for one
            concurrent.futures.wait([f for _, f, _ in self._pending.values()], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, (pending, future, url) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            try:
                if future.exception() is not None:
                    raise future.exception()
                self.inner.pd.finish_transferred_request(pending)
            except Exception as e:       # noqa: BLE001 (whatever went wrong, this request alone fails)
                self.inner.pd.cancel_transferred_request(pending)
                error = _request_error(e, url)
                logger.warning("request %s: its transfer failed: %s", request_id, error)
                self._failed.append((request_id, error))
        return self.inner.step() if self.inner.has_unfinished_requests() else []

    def take_failed_requests(self) -> list[tuple[str, RequestError]]:
        failed, self._failed = self._failed, []
        return failed

    def abort_request(self, request_id):
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return self.inner.abort_request(request_id)
        self.inner.pd.cancel_transferred_request(entry[0])     # its fetch, if still running, is dropped when done
        return None

    def close(self) -> None:
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self.inner.close()


def _request_error(e: Exception, prefill_url: str) -> RequestError:
    if isinstance(e, RequestError):
        return e
    if isinstance(e, PeerMismatchError):
        return RequestError(f"{e} (prefill server {prefill_url})", 502)
    if isinstance(e, ValueError):
        return RequestError(str(e), 400)
    return RequestError(f"the transfer from the prefill server {prefill_url} failed: {e!r}", 502)


def role_engine(engine: LLMEngine, options: PDOptions) -> PrefillRoleEngine | DecodeRoleEngine:
    """The engine for a PD server's engine loop; the model's identity is computed here, before serving (every
    bundle carries it, every transfer checks it)."""
    engine.model_identity()
    return PrefillRoleEngine(engine, options) if options.role == "prefill" else DecodeRoleEngine(engine)
