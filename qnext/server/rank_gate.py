"""Rank 0's HTTP front when the engine spans several processes (`qnext serve --nnodes N`).

Rank 0 listens before the other ranks have joined (joining, loading and compiling take minutes; a rank may never
come), so the front is up from the start and says why it cannot serve yet. Until the engine is open, and from the
moment a rank is lost, every route answers 503 with the reason (which ranks are missing or down and what to do);
otherwise requests pass to the app built over the engine. /health always answers here (200 only while every rank is
up and the engine loop runs) with `ranks_up` / `nnodes`; /metrics adds `qnext:ranks_up` and `qnext:ranks_total`.
The gate owns the engine loop's start and stop (the inner app's lifespan is not run)."""
from __future__ import annotations

import json
import logging
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger("qnext.server")


class RanksCollector:
    """qnext:ranks_up / qnext:ranks_total for a registry."""

    def __init__(self, ranks_up: Callable[[], int], nnodes: int):
        self._ranks_up, self._nnodes = ranks_up, nnodes

    def collect(self):
        up = GaugeMetricFamily("qnext:ranks_up", "Processes of the engine that are up (rank 0 included).")
        up.add_metric([], self._ranks_up())
        total = GaugeMetricFamily("qnext:ranks_total", "Processes the engine spans (--nnodes).")
        total.add_metric([], self._nnodes)
        yield up
        yield total


class RankGate:
    """An ASGI app: 503 with the reason while the engine is not servable, else the inner app."""

    def __init__(self, monitor, nnodes: int, shutdown_timeout: float = 30.0):
        self.monitor, self.nnodes, self.shutdown_timeout = monitor, nnodes, shutdown_timeout
        self.app = self.async_engine = self.engine = None
        self.start_error: str | None = None
        self._own_metrics = CollectorRegistry()
        self._own_metrics.register(RanksCollector(lambda: self.monitor.ranks_up, nnodes))

    # ---- the start-up thread -----------------------------------------------------------------------------------
    def open(self, app, async_engine, engine) -> None:
        """The engine is built on every rank: start its loop and pass requests on."""
        async_engine.start()
        self.app, self.async_engine, self.engine = app, async_engine, engine
        logger.info("all %d ranks are up; serving", self.nnodes)

    def fail(self, why: str) -> None:
        self.start_error = why
        logger.error("cannot serve: %s", why)

    # ---- state ---------------------------------------------------------------------------------------------------
    @property
    def lost_rank(self) -> bool:
        return self.monitor.failure() is not None or (self.engine is not None and self.engine.failure is not None)

    def problem(self) -> str | None:
        """Why requests cannot be served now, or None."""
        if self.start_error is not None:
            return self.start_error
        lost = self.monitor.failure() or (self.engine.failure if self.engine is not None else None)
        if lost is not None:
            return f"the engine lost a rank: {lost}"
        if self.app is None:
            missing, refusal = self.monitor.missing(), self.monitor.last_refusal
            return (f"starting: {self.monitor.ranks_up} of {self.nnodes} ranks up"
                    + (f" (waiting for rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))})"
                       if missing else " (joining, loading and warming up the model)")
                    + (f"; {refusal}" if missing and refusal else ""))
        if not self.async_engine.is_running:
            fatal = self.async_engine.fatal_error
            return f"the engine loop stopped: {fatal}" if fatal is not None else "the engine loop stopped"
        return None

    def health(self) -> tuple[int, dict]:
        problem = self.problem()
        body = {"status": "ok" if problem is None else "unavailable", "nnodes": self.nnodes,
                "ranks_up": self.monitor.ranks_up}
        if problem is not None:
            body["message"] = problem
        if self.async_engine is not None:
            snap = self.async_engine.snapshot()
            body.update(num_requests_running=snap.num_running, num_requests_waiting=snap.num_waiting)
        return (200 if problem is None else 503), body

    # ---- ASGI ------------------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        path = scope.get("path", "")
        if scope["type"] == "http" and path == "/health":
            status, body = self.health()
            return await _send(send, status, json.dumps(body).encode(), "application/json")
        if scope["type"] == "http" and path == "/metrics" and self.app is None:
            return await _send(send, 200, generate_latest(self._own_metrics), "text/plain; version=0.0.4")
        problem = None if path == "/metrics" else self.problem()
        if problem is not None or self.app is None:
            if scope["type"] != "http":
                return
            body = {"error": {"message": problem, "type": "server_error", "param": None,
                              "code": "starting" if self.app is None and self.start_error is None else "ranks_down"}}
            return await _send(send, 503, json.dumps(body).encode(), "application/json")
        await self.app(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.async_engine is not None:      # rank 0's close stops the other ranks
                    # with a rank lost, the engine thread may be stuck in a collective: do not wait for it long
                    self.async_engine.stop(1.0 if self.lost_rank else self.shutdown_timeout)
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _send(send, status: int, body: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
