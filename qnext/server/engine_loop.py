"""The async front end: one engine thread owns the LLMEngine; asyncio handlers talk to it through queues.

Handlers put commands (add, abort, stop) on a thread-safe queue. The engine thread applies them between steps,
steps while any request is live, and hands each request its outputs through that request's asyncio queue
(loop.call_soon_threadsafe). Nothing but the engine thread touches the engine; other threads read only the
`EngineSnapshot` it publishes after every step."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import time

from qnext.outputs import RequestOutput
from qnext.sampling_params import SamplingParams
from qnext.served_engine import EngineSnapshot, ServedEngine, ServedModel
from qnext.server.engine_errors import EngineStepError, EngineStoppedError, QueueFullError, RequestError
from qnext.server.engine_front import EngineFront
from qnext.server.request_stream import RequestStream

logger = logging.getLogger("qnext.server")


class AsyncEngine(EngineFront):
    """Owns a ServedEngine (qnext/served_engine.py) through one background thread. `observer` (metrics) gets
    on_first_token(stream) and on_finish(stream, output) calls from the engine thread. After each step, the requests
    the engine failed alone (take_failed_requests) get their error."""

    def __init__(self, engine: ServedEngine, *, max_waiting_requests: int, observer=None,
                 idle_wake_s: float | None = None, fatal_errors: tuple[type[BaseException], ...] = ()):
        """idle_wake_s: an idle loop still asks the engine whether it has work this often (an engine over several
        processes keeps them in step while idle). fatal_errors: step errors that stop the loop (every live request
        and every later one fails with EngineStoppedError carrying the error's message) instead of failing only the
        running requests."""
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, RequestStream] = {}       # engine thread only
        self._lock = threading.Lock()
        self._num_queued = 0                             # submitted, not yet taken by the engine thread
        self._snapshot = EngineSnapshot()
        self._thread = threading.Thread(target=self._run, name="qnext-engine", daemon=True)
        self._accepting = True                           # False once the engine thread is leaving (under _lock)
        self.fatal_error: BaseException | None = None
        self._idle_wake_s = idle_wake_s
        self._fatal_errors = fatal_errors

    # ---- any thread --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread.start()

    @property
    def served_model(self) -> ServedModel:
        return self.engine.served_model

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._accepting and self.fatal_error is None

    @property
    def down_reason(self) -> str | None:
        if self.is_running:
            return None
        return str(self.fatal_error) if self.fatal_error is not None else "the engine loop is not running"

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def health_details(self) -> dict:
        return {}

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            snap = dataclasses.replace(self._snapshot)
            snap.num_waiting += self._num_queued
            return snap

    def in_flight(self) -> int:
        """Requests submitted and not yet finished, as of now (the snapshot lags by up to a step)."""
        with self._lock:
            return len(self._live) + self._num_queued

    def admitted(self) -> int:
        """Of those, the ones the engine has taken."""
        return len(self._live)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abandon(self, error: EngineStoppedError) -> None:
        """From another thread, when the engine thread is stuck in a step that will not return (a rank of the engine
        hangs): every live request gets `error`, and no new one is taken. The engine thread is left where it is."""
        with self._lock:
            self._accepting = False
        self.fatal_error = error
        for stream in list(self._live.values()):
            stream.push(error)

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is still live, joins the engine thread, then closes the engine (which writes the prefix
        cache to prefix_cache_dir when one is set)."""
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    # ---- the event loop --------------------------------------------------------------------------------------
    async def add(self, request_id: str, prompt: dict, params: SamplingParams) -> RequestStream:
        """Queues a request and waits until the engine has accepted it. Raises QueueFullError, the engine's
        ValueError for a bad request, or EngineStoppedError."""
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.abort)
        with self._lock:           # under the lock: a command is never queued after the engine thread has left
            if not self._accepting or not self._thread.is_alive():
                raise EngineStoppedError("the engine loop is not running")
            waiting = self._snapshot.num_waiting + self._num_queued
            if waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{waiting} requests are already waiting (max_waiting_requests is "
                                     f"{self.max_waiting_requests}); retry later")
            self._num_queued += 1
            self._commands.put(("add", (stream, prompt, params)))
        try:
            await stream.admitted
        except BaseException:
            stream.finished = True      # rejected by the engine, or the client left: nothing to abort twice
            self.abort(request_id)
            raise
        return stream

    # ---- the engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self._live and not self.engine.has_unfinished_requests()
                if not self._apply_commands(block):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except BaseException as e:               # a bug in the loop itself: fail everything, stop serving
            logger.exception("the engine loop died")
            self.fatal_error = e
            fatal = isinstance(e, self._fatal_errors)
            self._fail(list(self._live), EngineStoppedError(str(e) if fatal else f"the engine loop died: {e!r}"))
        finally:
            with self._lock:
                self._accepting = False
            self._reject_queued()

    def _reject_queued(self) -> None:
        """Answers the adds still queued when the loop ends, so that no handler waits forever."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                arg[0].resolve_admission(EngineStoppedError("the server is shutting down"))

    def _apply_commands(self, block: bool) -> bool:
        """Applies queued commands (waiting for one when idle); False once told to stop."""
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self._idle_wake_s))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        num_taken, stopping = 0, False
        for kind, arg in commands:
            if kind == "add":
                num_taken += 1
                if stopping:
                    arg[0].resolve_admission(EngineStoppedError("the server is shutting down"))
                else:
                    self._add(*arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "stop":
                stopping = True
        if stopping:
            self._fail(list(self._live), EngineStoppedError("the server is shutting down"))
        self._publish(num_taken)
        return not stopping

    def _add(self, stream: RequestStream, prompt: dict, params: SamplingParams) -> None:
        try:
            self.engine.add_request(stream.request_id, prompt, params)
        except Exception as e:       # bad input (ValueError) goes back to the client; the loop goes on
            refused = isinstance(e, (ValueError, RequestError))
            stream.resolve_admission(e if refused else EngineStepError(f"add_request: {e!r}"))
            return
        self._live[stream.request_id] = stream
        stream.resolve_admission(None)

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self._abort_in_engine(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        """Frees the request's rows and blocks; an engine that fails at it is logged, the loop goes on."""
        try:
            self.engine.abort_request(request_id)
            self.engine.release(request_id)
        except Exception:
            logger.exception("aborting request %s", request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except self._fatal_errors:
            raise
        except Exception as e:
            logger.exception("engine step failed")
            self._fail(self._affected_by_failed_step(), EngineStepError(f"the engine step failed: {e!r}"))
            outputs = []
        for request_id, error in self.engine.take_failed_requests():
            self._fail([request_id], error)
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is not None:
                self._deliver(stream, out)

    def _deliver(self, stream: RequestStream, out: RequestOutput) -> None:
        deltas = stream.deltas(out, self.engine.stream_text)
        if any(d.token_ids for d in deltas) and stream.first_token_time is None:
            stream.first_token_time = time.perf_counter()
            if self.observer is not None:
                self.observer.on_first_token(stream)
        if out.finished:
            self._live.pop(out.request_id, None)
            self.engine.release(out.request_id)
            if self.observer is not None:
                self.observer.on_finish(stream, out)
        if deltas:
            deltas[-1].final = out.finished
        for delta in deltas:
            stream.push(delta)

    def _affected_by_failed_step(self) -> list[str]:
        """The live requests that were running; all live ones when none was (the step failed admitting them)."""
        running = [rid for rid in self.engine.running_request_ids() if rid in self._live]
        return running or list(self._live)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._live.pop(rid, None)
            self._abort_in_engine(rid)
            if stream is not None:
                stream.push(error)

    def _publish(self, num_taken: int = 0) -> None:
        snap = self.engine.status()
        with self._lock:
            self._num_queued -= num_taken
            self._snapshot = snap
