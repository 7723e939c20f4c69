"""`qnext serve --pd-role prefill|decode`: one side of prefill/decode disaggregation (docs/scale.md).

The router (qnext/server/pd_router.py) sends a request's body to a prefill server with the header
`x-qnext-pd: {"request_id": ID}`, then the same body to a decode server with
`x-qnext-pd: {"request_id": ID2, "prefill_url": URL, "prefill_request_id": ID}`. Every API route works unchanged:
the header reaches Admission through a context variable (set by `PDHeaderMiddleware` around the request), which
names the engine request after it and hands the decode side's source to the engine adapter.

- prefill: every request runs its prompt and stops after the first token (finish_reason "prefilled" unless that
  token ends it); its bundle waits in the engine's PrefillExports for the decode side, which reads the metadata at
  GET /pd/bundles/{id} and asks for the missing blocks at POST /pd/bundles/{id}/pull (pd_mover.py).
- decode: a request with the header fetches what its cache lacks from the prefill server and decodes from the
  first token on; a request without it is served as by any server. Any client can send the header, so the decode
  server fetches only from the prefill servers it was started with (`--pd-prefill-url`, repeatable): a header
  naming another address is a 400, and nothing is fetched.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import logging
import urllib.parse

import httpx

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from qnext.server.pd_mover import PD_HEADER, PrefillMover, RemoteBundle

logger = logging.getLogger("qnext.server")

PD_ROLES = ("prefill", "decode")
PD_REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("qnext_pd_request", default=None)


def prefill_url_allow_list(role: str | None, prefill_urls) -> tuple[str, ...]:
    """`--pd-prefill-url` checked against `--pd-role`: the prefill servers (http(s)://host:port) a decode server may
    fetch from, without a trailing slash. A decode server needs at least one; other roles take none."""
    urls = tuple(u.rstrip("/") for u in prefill_urls or ())
    if role == "decode" and not urls:
        raise ValueError("--pd-role decode needs --pd-prefill-url URL (repeatable): the prefill servers it may fetch "
                         "from; the x-qnext-pd header of a request names one of them")
    if role != "decode" and urls:
        raise ValueError("--pd-prefill-url is for --pd-role decode")
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query:
            raise ValueError(f"--pd-prefill-url {url!r} is not a server's base URL (http(s)://host:port)")
    return urls


class PDHeaderMiddleware:
    """Sets PD_REQUEST from the `x-qnext-pd` header for the request's whole handling (pure ASGI, so the route's
    task sees it). A 400, before the body is read: a header that is not a JSON object with a string request_id, and
    a prefill_url that is not in `prefill_urls` (the decode server's allow-list; empty on a prefill server)."""

    def __init__(self, app, prefill_urls: tuple[str, ...] = ()):
        self.app, self.prefill_urls = app, prefill_urls

    async def __call__(self, scope, receive, send):
        raw = dict(scope.get("headers") or []).get(PD_HEADER.encode()) if scope["type"] == "http" else None
        if raw is None:
            return await self.app(scope, receive, send)
        try:
            value = json.loads(raw)
            if not isinstance(value, dict) or not isinstance(value.get("request_id"), str):
                raise ValueError
        except ValueError:
            return await _bad_header(f"the {PD_HEADER} header must be a JSON object with a string request_id",
                                     scope, receive, send)
        url = value.get("prefill_url")
        if url is not None and (not isinstance(url, str) or url.rstrip("/") not in self.prefill_urls):
            allowed = ", ".join(self.prefill_urls) or "none: this is not a decode server"
            return await _bad_header(f"the {PD_HEADER} header's prefill_url {url!r} is not a prefill server this "
                                     f"server may fetch from (--pd-prefill-url: {allowed})", scope, receive, send)
        token = PD_REQUEST.set(value)
        try:
            await self.app(scope, receive, send)
        finally:
            PD_REQUEST.reset(token)


async def _bad_header(message: str, scope, receive, send) -> None:
    response = JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, 400)
    await response(scope, receive, send)


class _RoleEngine:
    """The engine as the engine loop sees it, with add_request taking the request's PD role."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)


class PrefillRoleEngine(_RoleEngine):
    def add_request(self, request_id, prompt, params=None):
        self._engine.add_prefill_request(request_id, prompt, params)


class DecodeRoleEngine(_RoleEngine):
    """A request with a prefill source: its hold and checks on the engine thread, its fetch on a worker thread
    (the engine keeps stepping meanwhile), its admission on the engine thread once the arrays are here (`step`).
    A transfer that fails is logged and the request computed here instead, from its prompt."""

    def __init__(self, engine, max_fetches: int = 4):
        super().__init__(engine)
        self._fetches = concurrent.futures.ThreadPoolExecutor(max_fetches, thread_name_prefix="qnext-pd-fetch")
        self._pending: dict[str, tuple] = {}     # request id -> (PendingTransfer, future, prompt, params)

    def add_request(self, request_id, prompt, params=None):
        source = prompt.pop("pd_source", None) if isinstance(prompt, dict) else None
        if source is None:
            return self._engine.add_request(request_id, prompt, params)
        url, prefill_id = source.get("prefill_url"), source.get("prefill_request_id")
        if not isinstance(url, str) or not isinstance(prefill_id, str):
            raise ValueError(f"the {PD_HEADER} header of a decode request needs prefill_url and prefill_request_id")
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            bundle = RemoteBundle(url, prefill_id)
        except (ValueError, httpx.HTTPError) as e:
            logger.warning("request %s: no prefill bundle (%s); computing its prompt here", request_id, e)
            return self._engine.add_request(request_id, prompt, params)
        pending = self._engine.begin_transferred_request(request_id, prompt, params, bundle.meta)
        self._pending[request_id] = (pending, self._fetches.submit(pending.fetch, bundle), prompt, params)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self._engine.has_unfinished_requests()

    @property
    def num_waiting(self) -> int:
        return self._engine.num_waiting + len(self._pending)

    def step(self):
        if self._pending and not self._engine.has_unfinished_requests():     # only fetches: wait for one
            concurrent.futures.wait([f for _, f, _, _ in self._pending.values()], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, (pending, future, prompt, params) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            if future.exception() is None:
                self._engine.finish_transferred_request(pending)
                continue
            logger.warning("request %s: its transfer failed (%r); computing its prompt here", request_id,
                           future.exception())
            self._engine.cancel_transferred_request(pending)
            self._engine.add_request(request_id, prompt, params)
        return self._engine.step() if self._engine.has_unfinished_requests() else []

    def abort_request(self, request_id):
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return self._engine.abort_request(request_id)
        self._engine.cancel_transferred_request(entry[0])     # its fetch, if still running, is dropped when done
        return None


def role_engine(engine, role: str):
    if role not in PD_ROLES:
        raise ValueError(f"--pd-role must be one of {PD_ROLES}, got {role!r}")
    return PrefillRoleEngine(engine) if role == "prefill" else DecodeRoleEngine(engine)


class PullRequest(BaseModel):
    first_block: int
    num_kv_layers: int


def install_pd_routes(app: FastAPI, engine, role: str, transfer_host: str = "127.0.0.1",
                      prefill_urls: tuple[str, ...] = ()) -> None:
    """The header middleware, and on a prefill server the bundle routes. prefill_urls: a decode server's
    allow-list, as prefill_url_allow_list returns it."""
    app.add_middleware(PDHeaderMiddleware, prefill_urls=prefill_urls)
    if role != "prefill":
        return
    exports, mover = engine.prefill_exports, PrefillMover(transfer_host)

    @app.get("/pd/bundles/{request_id}")
    async def bundle_meta(request_id: str):
        bundle = exports.get(request_id)
        if bundle is None:
            return _no_bundle(request_id)
        return bundle.meta

    @app.post("/pd/bundles/{request_id}/pull")
    async def bundle_pull(request_id: str, body: PullRequest):
        bundle = exports.take(request_id)        # one pull per bundle
        if bundle is None:
            return _no_bundle(request_id)
        if not 0 <= body.first_block <= bundle.meta["num_blocks"]:
            return JSONResponse({"error": {"message": f"first_block {body.first_block} is outside the bundle's "
                                           f"{bundle.meta['num_blocks']} blocks"}}, 400)
        return await asyncio.to_thread(mover.prepare, bundle, body.first_block, body.num_kv_layers)


def _no_bundle(request_id: str) -> JSONResponse:
    return JSONResponse({"error": {"message": f"no prefill bundle {request_id!r} (never made, already pulled, or "
                                   "expired)", "type": "not_found_error"}}, 404)
