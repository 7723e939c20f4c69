"""`qnext pd-router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]`: the front of prefill/decode
disaggregation (docs/pd.md).

For each completion or chat completion, one prefill and one decode server are chosen (pd_choice.py: the one whose
earlier requests share the longest prefix with it, else the least busy); the body goes to the prefill server (not
streamed) under a fresh id in the
`x-qnext-pd` header; when it answers finish_reason "prefilled", the same body goes to the decode server with the
prefill server's address and that id, and the decode server's answer (JSON or the event stream) is passed
through as it comes. A request the first token already ended, or one with n > 1, goes to the decode server
plainly. A server that cannot be reached is a 503 naming it. Other routes (/v1/models) are the first decode
server's; /health asks every server.
"""
from __future__ import annotations

import contextlib
import json
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from qnext.server.pd_choice import ServerPool, prefix_chain
from qnext.server.pd_mover import PD_HEADER

# the client's headers that reach the servers behind the router: its API key only (never a cluster secret header
# SECRET_HEADER, nor an x-qnext-pd header of its own: the router writes that one)
FORWARDED_HEADERS = ("authorization", "x-api-key")


def build_pd_router(prefill_urls: list[str] | str, decode_urls: list[str] | str, timeout: float = 600.0) -> FastAPI:
    prefills, decodes = (ServerPool([u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)])
                         for urls in (prefill_urls, decode_urls))
    client = httpx.AsyncClient(timeout=timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="qnext pd-router", lifespan=lifespan)

    async def disaggregated(request: Request) -> Response:
        path = request.url.path
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON", "type": "invalid_request_error"}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body is not a JSON object",
                                           "type": "invalid_request_error"}}, 400)
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        decode_headers = dict(headers)
        chain = prefix_chain(body)
        if body.get("n", 1) == 1:
            request_id = f"pd-{uuid.uuid4().hex}"
            prefill_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            p = prefills.choose(chain)
            prefill_url = prefills.urls[p]
            prefills.started(p)
            try:
                prefilled = await client.post(prefill_url + path, json=prefill_body,
                                              headers={**headers, PD_HEADER: json.dumps({"request_id": request_id})})
            except httpx.HTTPError as e:
                return _unavailable("prefill", prefill_url, e)
            finally:
                prefills.finished(p)
            if prefilled.status_code != 200:
                return Response(prefilled.content, prefilled.status_code, media_type="application/json")
            if _finish_reason(prefilled) == "prefilled":
                decode_headers[PD_HEADER] = json.dumps({"request_id": request_id, "prefill_url": prefill_url,
                                                        "prefill_request_id": request_id})
        d = decodes.choose(chain)
        decodes.started(d)
        try:
            return await _passed_through(client, decodes.urls[d] + path, body, decode_headers,
                                         done=lambda: decodes.finished(d))
        except httpx.HTTPError as e:
            decodes.finished(d)
            return _unavailable("decode", decodes.urls[d], e)
        except BaseException:
            decodes.finished(d)
            raise

    app.add_api_route("/v1/chat/completions", disaggregated, methods=["POST"])
    app.add_api_route("/v1/completions", disaggregated, methods=["POST"])

    @app.get("/health")
    async def health():
        states = {}
        servers = [(f"prefill {url}", url) for url in prefills.urls] + [(f"decode {url}", url) for url in decodes.urls]
        for name, url in servers:
            try:
                states[name] = (await client.get(url + "/health")).status_code
            except httpx.HTTPError as e:
                states[name] = repr(e)
        ok = all(code == 200 for code in states.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", **states}, 200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            answer = await client.get(decodes.urls[0] + "/v1/models",
                                      headers={k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS})
        except httpx.HTTPError as e:
            return _unavailable("decode", decodes.urls[0], e)
        return Response(answer.content, answer.status_code, media_type="application/json")

    return app


def _finish_reason(answer: httpx.Response) -> str | None:
    try:
        return answer.json()["choices"][0].get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def _unavailable(role: str, url: str, e: httpx.HTTPError) -> JSONResponse:
    """A server behind the router that cannot be reached (or did not answer in time): 503 saying which and why."""
    why = "did not answer in time" if isinstance(e, httpx.TimeoutException) else f"cannot be reached ({e!r})"
    return JSONResponse({"error": {"message": f"the {role} server {url} {why}; retry later", "type": "server_error",
                                   "code": f"{role}_unavailable"}}, 503, headers={"Retry-After": "1"})


async def _passed_through(client: httpx.AsyncClient, url: str, body, headers: dict, done) -> Response:
    """The answer of `url` streamed through; done() runs once it is closed."""
    answer = await client.send(client.build_request("POST", url, json=body, headers=headers), stream=True)

    async def close():
        try:
            await answer.aclose()
        finally:
            done()

    return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                             media_type=answer.headers.get("content-type"), background=BackgroundTask(close))
