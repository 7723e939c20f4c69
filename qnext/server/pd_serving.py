"""`qnext serve --pd-role prefill|decode`: one side of prefill/decode disaggregation (docs/pd.md).

The router (qnext/server/pd_router.py) sends a request's body to a prefill server with the header
`x-qnext-pd: {"request_id": ID}`, then the same body to a decode server with
`x-qnext-pd: {"request_id": ID2, "prefill_url": URL, "prefill_request_id": ID}`. Every API route works unchanged:
the header reaches Admission through a context variable (set by `PDHeaderMiddleware` around the request), which
names the engine request after it and, on a decode server, reads the bundle's metadata (off the engine thread,
within --pd-timeout) before the request reaches the engine (pd_role_engines.py).

- prefill: a request with the header runs its prompt and stops after the first token (finish_reason "prefilled"
  unless that token ends it); its bundle waits in the engine's PrefillExports for the decode side, which reads the
  metadata at GET /pd/bundles/{id} and asks for the missing blocks at POST /pd/bundles/{id}/pull (pd_mover.py).
  A request without the header is served whole, as by any server.
- decode: a request with the header fetches what its cache lacks from the prefill server and decodes from the
  first token on; a request without it is served as by any server. Any client can send the header, so the decode
  server fetches only from the prefill servers it was started with (`--pd-prefill-url`, repeatable): a header
  naming another address, or ids other than letters, digits, '-' and '_', is a 400, and nothing is fetched.

/pd/* wants the cluster secret (header x-qnext-cluster-key) when the server has one (docs/security.md).
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from qnext.distributed.cluster_secret import SECRET_HEADER, ClusterSecret
from qnext.server.engine_errors import RequestError
from qnext.server.pd_mover import PD_HEADER, PrefillMover, RemoteBundle, check_pd_id, read_bundle_meta
from qnext.server.pd_options import PDOptions

logger = logging.getLogger("qnext.server")

PD_PREFIX = "/pd/"


@dataclasses.dataclass(frozen=True)
class PDRequest:
    """A request's x-qnext-pd header, checked; `source` is set by `with_source` (decode side)."""
    request_id: str
    options: PDOptions
    prefill_url: str | None = None
    prefill_request_id: str | None = None
    source: RemoteBundle | None = None

    async def with_source(self) -> "PDRequest":
        """This request with its prefill bundle's metadata read (None: no prefill_url, or the prefill server has
        no such bundle any more, and the decode server computes the prompt itself). RequestError 504 / 502 when the
        prefill server does not answer in time / answers wrongly."""
        if self.prefill_url is None:
            return self
        o = self.options
        try:
            meta = await asyncio.wait_for(asyncio.to_thread(read_bundle_meta, self.prefill_url,
                                                            self.prefill_request_id, o.timeout_s, o.secret),
                                          o.timeout_s + 1.0)
        except asyncio.TimeoutError:
            raise RequestError(f"the prefill server {self.prefill_url} did not send bundle "
                               f"{self.prefill_request_id!r}'s metadata within --pd-timeout {o.timeout_s:g} s",
                               504) from None
        if meta is None:
            logger.warning("request %s: the prefill server %s has no bundle %r; computing its prompt here",
                           self.request_id, self.prefill_url, self.prefill_request_id)
            return self
        source = RemoteBundle(self.prefill_url, self.prefill_request_id, meta, o.timeout_s, o.secret,
                              o.transfer_host)
        return dataclasses.replace(self, source=source)


PD_REQUEST: contextvars.ContextVar[PDRequest | None] = contextvars.ContextVar("qnext_pd_request", default=None)


def parse_pd_header(raw: bytes, options: PDOptions) -> PDRequest:
    """ValueError saying what is wrong with an x-qnext-pd header's value."""
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"the {PD_HEADER} header must be a JSON object with a string request_id")
    request_id = check_pd_id(value.get("request_id"), f"the {PD_HEADER} header's request_id")
    url = value.get("prefill_url")
    if url is None:
        return PDRequest(request_id, options)
    if not isinstance(url, str) or url.rstrip("/") not in options.prefill_urls:
        allowed = ", ".join(options.prefill_urls) or "none: this is not a decode server"
        raise ValueError(f"the {PD_HEADER} header's prefill_url {url!r} is not a prefill server this server may "
                         f"fetch from (--pd-prefill-url: {allowed})")
    prefill_id = check_pd_id(value.get("prefill_request_id"), f"the {PD_HEADER} header's prefill_request_id")
    return PDRequest(request_id, options, url.rstrip("/"), prefill_id)


class PDHeaderMiddleware:
    """Sets PD_REQUEST from the `x-qnext-pd` header for the request's whole handling (pure ASGI, so the route's
    task sees it); a header parse_pd_header refuses is a 400, before the body is read."""

    def __init__(self, app, options: PDOptions):
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send):
        raw = dict(scope.get("headers") or []).get(PD_HEADER.encode()) if scope["type"] == "http" else None
        if raw is None:
            return await self.app(scope, receive, send)
        try:
            pd = parse_pd_header(raw, self.options)
        except ValueError as e:
            return await _error(400, str(e), "invalid_request_error", scope, receive, send)
        token = PD_REQUEST.set(pd)
        try:
            await self.app(scope, receive, send)
        finally:
            PD_REQUEST.reset(token)


class ClusterSecretMiddleware:
    """/pd/* wants the cluster secret in SECRET_HEADER (constant-time): 401 without it, 403 with another one."""

    def __init__(self, app, secret: ClusterSecret):
        self.app, self.secret = app, secret

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PD_PREFIX):
            return await self.app(scope, receive, send)
        presented = dict(scope.get("headers") or []).get(SECRET_HEADER.encode())
        if self.secret.matches(presented):
            return await self.app(scope, receive, send)
        if presented is None:
            return await _error(401, f"{PD_PREFIX}* wants the cluster secret in the {SECRET_HEADER} header",
                                "authentication_error", scope, receive, send)
        await _error(403, "wrong cluster secret", "permission_error", scope, receive, send)


async def _error(status: int, message: str, kind: str, scope, receive, send) -> None:
    await JSONResponse({"error": {"message": message, "type": kind}}, status)(scope, receive, send)


class PullRequest(BaseModel):
    first_block: int
    num_kv_layers: int


def install_pd_routes(app: FastAPI, engine, options: PDOptions) -> None:
    """The header middleware, and on a prefill server the bundle routes over its role engine's exports (behind the
    secret when there is one)."""
    app.add_middleware(PDHeaderMiddleware, options=options)
    if options.secret is not None:
        app.add_middleware(ClusterSecretMiddleware, secret=options.secret)
    if options.role != "prefill":
        return
    exports, mover = engine.exports, PrefillMover(options.transfer_host, options.offer_ttl_s)

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
        if not 0 <= body.first_block <= bundle.meta["num_blocks"] or body.num_kv_layers < 0:
            return JSONResponse({"error": {"message": f"first_block {body.first_block} is outside the bundle's "
                                           f"{bundle.meta['num_blocks']} blocks, or num_kv_layers "
                                           f"{body.num_kv_layers} is negative", "type": "invalid_request_error"}},
                                400)
        return await asyncio.to_thread(mover.prepare, bundle, body.first_block, body.num_kv_layers)


def _no_bundle(request_id: str) -> JSONResponse:
    return JSONResponse({"error": {"message": f"no prefill bundle {request_id!r} (never made, already pulled, or "
                                   "expired)", "type": "not_found_error"}}, 404)
