"""The FastAPI application: OpenAI routes, /health and /metrics over one AsyncEngine."""
from __future__ import annotations

import contextlib
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from qnext.server.engine_loop import AsyncEngine
from qnext.server.errors import install_error_handlers
from qnext.server.metrics import CONTENT_TYPE, ServerMetrics, cache_usage
from qnext.server.serving import OpenAIServing


def build_async_engine(engine, *, max_waiting_requests: int, model_name: str) -> tuple[AsyncEngine, ServerMetrics]:
    """The engine loop and its metrics, wired together (the loop is started by the app's lifespan)."""
    holder: list[AsyncEngine] = []
    metrics = ServerMetrics(lambda: holder[0].snapshot(), model_name)
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests, observer=metrics,
                               usage_of=cache_usage)
    holder.append(async_engine)
    return async_engine, metrics


def build_app(engine, *, model_name: str, max_waiting_requests: int = 256, async_engine=None,
              metrics=None) -> FastAPI:
    """An app serving `engine` (an LLMEngine, or anything with its methods). Starting the app starts the engine
    thread; stopping it aborts what is left and joins the thread. `async_engine` and `metrics` replace the one
    engine loop (data parallelism: qnext/server/data_parallel.py)."""
    if async_engine is None:
        async_engine, metrics = build_async_engine(engine, max_waiting_requests=max_waiting_requests,
                                                   model_name=model_name)
    serving = OpenAIServing(async_engine, model_name)
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat_completions(request)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "qnext",
                "max_model_len": serving.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        snap = async_engine.snapshot()
        body = {"status": "ok" if async_engine.is_running else "engine stopped",
                "num_requests_running": snap.num_running, "num_requests_waiting": snap.num_waiting}
        return JSONResponse(body, status_code=200 if async_engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
