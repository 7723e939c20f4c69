"""The HTTP process's handle on a data parallel replica that runs in its own process (replica_worker.py).

`ProcessReplica` is an EngineFront (engine_front.py), as AsyncEngine is, so the router (data_parallel.py) treats
thread and process replicas alike; of the engine, the HTTP side holds only its ServedModel (`served_model_of`: the
replica's limits, with the tokenizer and picture preprocessing loaded here). A reader thread turns the replica's
messages into the request streams' deltas and the metrics observer's calls (first token, finish: timed here, where the client waits).
When the replica's process exits, its pipe closes: the replica is marked down, every request it held fails with
ReplicaDownError (503, naming the replica and its exit code), and the router stops sending it requests."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time

from qnext.sampling_params import SamplingParams
from qnext.served_engine import EngineSnapshot, ServedModel
from qnext.server.engine_front import EngineFront
from qnext.server.engine_errors import EngineStepError, EngineStoppedError, QueueFullError
from qnext.server.replica_devices import ReplicaDevices
from qnext.server.request_stream import RequestStream

logger = logging.getLogger("qnext.server")

_ERRORS = {"QueueFullError": QueueFullError, "EngineStoppedError": EngineStoppedError,
           "EngineStepError": EngineStepError, "ValueError": ValueError}


class ReplicaDownError(EngineStoppedError):
    """The replica's process exited; its requests failed and the others serve on."""


class ProcessReplica(EngineFront):
    def __init__(self, devices: ReplicaDevices, model: str, engine_options: dict, *, max_waiting_requests: int,
                 warm_up: bool, log_level: str = "info"):
        """devices: the replica's assignment (replica_devices.assign_replica_devices); it refuses to start on others."""
        from qnext.server.replica_worker import run_replica

        self.index, self.devices, self.max_waiting_requests = devices.index, devices, max_waiting_requests
        self.observer = None                       # set by the router (metrics + its prefix table)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=run_replica, name=f"qnext-replica-{self.index}", daemon=True,
                                       args=(child, devices, str(model), engine_options, warm_up, log_level))
        self.process.start()
        child.close()
        self.info: dict = {}
        self.down: str | None = None
        self._served_model: ServedModel | None = None
        self._streams: dict[str, RequestStream] = {}
        self._num_admitting = 0
        self._snapshot = EngineSnapshot()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"qnext-replica-{self.index}-reader", daemon=True)

    # ---- start and stop ------------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> dict:
        """Waits for the replica's engine (loaded, warmed up) -> what it reported (max_model_len, block_size, ...)."""
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self.process.is_alive():
                raise ValueError(f"data parallel replica {self.index} exited with code {self.process.exitcode} "
                                 "while loading (its log lines above say why)")
            if time.monotonic() > deadline:
                raise ValueError(f"data parallel replica {self.index} was not ready within {timeout:.0f} s")
        kind, info = self._conn.recv()
        if kind == "refused":                      # it found other devices than it was given
            raise ValueError(info)
        assert kind == "ready", kind
        self.devices.check(info["platform"], info["device_count"])
        self.info = info
        return self.info

    def set_served_model(self, model: ServedModel) -> None:
        """Once ready: what the HTTP side reads of this replica's engine (served_model_of(self.info, ...))."""
        self._served_model = model

    @property
    def served_model(self) -> ServedModel:
        if self._served_model is None:
            raise RuntimeError(f"data parallel replica {self.index} has no served model yet (wait_ready, then "
                               "set_served_model)")
        return self._served_model

    def start(self) -> None:
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    @property
    def is_running(self) -> bool:
        return self.down is None and self.process.is_alive()

    @property
    def down_reason(self) -> str | None:
        if self.is_running:
            return None
        return self.down or f"data parallel replica {self.index} is not running"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def health_details(self) -> dict:
        return {}

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            snap = EngineSnapshot(**vars(self._snapshot))
            snap.num_waiting += self._num_admitting
        if self.down is not None:              # nothing runs or waits there any more
            snap.num_running = snap.num_waiting = 0
        return snap

    def in_flight(self) -> int:
        """Requests sent and not yet finished, as this process sees them now (the replica's snapshot lags by up to
        SNAPSHOT_EVERY_S)."""
        with self._lock:
            return len(self._streams)

    def admitted(self) -> int:
        """Of those, the ones the replica has taken (a replica that dies before taking one: it goes to another)."""
        with self._lock:
            return sum(s.admitted.done() for s in self._streams.values())

    # ---- the event loop ------------------------------------------------------------------------------------------
    async def add(self, request_id: str, prompt: dict, params: SamplingParams) -> RequestStream:
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.abort)
        with self._lock:
            if not self.is_running:
                raise ReplicaDownError(self.down_reason)
            waiting = self._snapshot.num_waiting + self._num_admitting
            if waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{waiting} requests are already waiting (max_waiting_requests is "
                                     f"{self.max_waiting_requests}); retry later")
            self._num_admitting += 1
            self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params))
        try:
            await stream.admitted
        except BaseException:
            stream.finished = True
            with self._lock:
                self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        finally:
            with self._lock:
                self._num_admitting -= 1
        return stream

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):
                pass                      # the reader thread sees the pipe close and fails what is left

    # ---- the reader thread ---------------------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._lost()
                return
            kind, rest = message[0], message[1:]
            if kind == "snapshot":
                with self._lock:
                    self._snapshot = rest[0]
                continue
            stream = self._streams.get(rest[0])
            if stream is None:
                continue
            if kind == "admitted":
                stream.resolve_admission(None)
            elif kind in ("rejected", "failed"):
                self._streams.pop(rest[0], None)
                error = _ERRORS.get(rest[1], EngineStepError)(rest[2])
                stream.resolve_admission(error) if kind == "rejected" else stream.push(error)
            elif kind == "delta":
                self._deliver(stream, rest[1])

    def _deliver(self, stream: RequestStream, delta) -> None:
        if delta.token_ids and stream.first_token_time is None:
            stream.first_token_time = time.perf_counter()
            if self.observer is not None:
                self.observer.on_first_token(stream)
        if delta.final:
            self._streams.pop(stream.request_id, None)
            if self.observer is not None:
                self.observer.on_finish(stream, delta.output)
        stream.push(delta)

    def _lost(self) -> None:
        self.process.join(2)
        self.down = (f"data parallel replica {self.index} (pid {self.process.pid}) exited with code "
                     f"{self.process.exitcode}; the requests it held failed, the other replicas go on serving; "
                     f"restart the server to bring it back")
        logger.error("%s", self.down)
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        error = ReplicaDownError(self.down)
        for stream in streams:
            stream.resolve_admission(error)
            stream.push(error)


def served_model_of(info: dict, tokenizer, vision=None) -> ServedModel:
    """A replica's ServedModel in the HTTP process: its limits as it reported them when ready, the tokenizer (loaded
    here) and the picture preprocessing (a VisionSetup without weights: the replica runs the tower). Structured
    outputs are checked by the replica's engine when it takes the request (a bad one is refused there, 400)."""
    return ServedModel(tokenizer, info["max_model_len"], info["vocab_size"], info["block_size"], info["num_blocks"],
                       vision)
