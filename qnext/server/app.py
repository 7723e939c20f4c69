"""The FastAPI application: OpenAI routes, Anthropic Messages and OpenAI Responses routes, /health and /metrics
over one AsyncEngine."""
from __future__ import annotations

import contextlib
import time
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from qnext.served_engine import ServedEngine
from qnext.server.admission import Admission
from qnext.server.agent_serving import AgentServing
from qnext.server.auth import APIKeyMiddleware
from qnext.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from qnext.server.engine_loop import AsyncEngine
from qnext.server.errors import install_error_handlers
from qnext.server.lora_adapters import ServedAdapters, adapter_cards, install_lora_routes
from qnext.server.metrics import CONTENT_TYPE, ServerMetrics
from qnext.server.pd_options import PDOptions
from qnext.server.pd_role_engines import role_engine
from qnext.server.pd_serving import install_pd_routes
from qnext.server.serving import OpenAIServing
from qnext.vision.media import MediaLimits


def build_async_engine(engine: ServedEngine, *, max_waiting_requests: int, model_name: str,
                       **loop_options) -> tuple[AsyncEngine, ServerMetrics]:
    """The engine loop and its metrics, wired together (the loop is started by the app's lifespan). loop_options:
    AsyncEngine's idle_wake_s / fatal_errors."""
    holder: list[AsyncEngine] = []
    metrics = ServerMetrics(lambda: holder[0].snapshot(), model_name)
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests, observer=metrics, **loop_options)
    holder.append(async_engine)
    return async_engine, metrics


def build_app(engine: ServedEngine | None, *, model_name: str, aliases: Sequence[str] = (), max_waiting_requests: int = 256,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, async_engine=None, metrics=None,
              media_limits: MediaLimits = MediaLimits(), pd: PDOptions | None = None,
              adapters: ServedAdapters | None = None) -> FastAPI:
    """An app serving `engine` (a ServedEngine: qnext/served_engine.py) as `model_name` (and `aliases`).
    Starting the app starts the engine thread; stopping it aborts what is left and joins the thread.
    tool_call_parser / reasoning_parser: parser names (None: chosen from the chat template; "none": off). With
    `api_key`, /v1 routes want it (auth.py); bodies past `max_request_bytes` get 413 (body_limit.py).
    `async_engine` (an EngineFront) and `metrics` replace the one engine loop over `engine`, which may then be None
    (data parallelism: qnext/server/data_parallel.py).
    media_limits: pictures per request, bytes, pixels, URL fetching (qnext/vision/media.py). pd: one side of
    prefill/decode disaggregation, its links and limits (server/pd_options.py, pd_serving.py). adapters: the LoRA
    adapters served by name, and the load / unload routes (server/lora_adapters.py; None: LoRA is off)."""
    if pd is not None:
        engine = role_engine(engine, pd)
    if async_engine is None:
        async_engine, metrics = build_async_engine(engine, max_waiting_requests=max_waiting_requests,
                                                   model_name=model_name)
    admission = Admission(async_engine, model_name, aliases=aliases, tool_call_parser=tool_call_parser,
                          reasoning_parser=reasoning_parser, media_limits=media_limits, adapters=adapters)
    serving, agents = OpenAIServing(admission), AgentServing(admission)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="qnext", lifespan=lifespan)
    app.state.async_engine, app.state.metrics = async_engine, metrics
    install_error_handlers(app, metrics.count_error)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if pd is not None:
        install_pd_routes(app, engine, pd)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)       # outermost: refused before the body is read
    if adapters is not None:
        install_lora_routes(app, adapters, api_key)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat_completions(request)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await agents.messages(request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await agents.count_tokens(request)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await agents.responses(request)

    @app.get("/v1/models")
    async def models():
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "qnext",
                  "max_model_len": admission.max_model_len} for name in admission.model_names]
        if adapters is not None:
            cards += adapter_cards(adapters, admission.model_name, created, admission.max_model_len)
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health():
        snap = async_engine.snapshot()
        body = {"status": "ok" if async_engine.is_running else "engine stopped",
                "num_requests_running": snap.num_running, "num_requests_waiting": snap.num_waiting,
                **async_engine.health_details()}
        return JSONResponse(body, status_code=200 if async_engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
