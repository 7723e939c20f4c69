"""What the HTTP side holds of the engine it serves: requests in (add, abort), streams out, and the state /health and
/metrics read. One engine loop in this process (engine_loop.AsyncEngine), a data parallel replica in its own process
(replica_process.ProcessReplica) and the router over N of either (data_parallel.DataParallelEngine) each implement it
in full, so the router treats its replicas alike and the app treats all three alike.

The engine itself (qnext/served_engine.py) is behind it, on the engine loop's thread or in another process; only its
`served_model` (tokenizer, limits) crosses over."""
from __future__ import annotations

import abc

from qnext.sampling_params import SamplingParams
from qnext.served_engine import EngineSnapshot, ServedModel
from qnext.server.request_stream import RequestStream


class EngineFront(abc.ABC):
    @property
    @abc.abstractmethod
    def served_model(self) -> ServedModel:
        """The tokenizer and limits (Admission reads them once)."""

    @abc.abstractmethod
    def start(self) -> None:
        """Starts serving (the app's lifespan calls it)."""

    @abc.abstractmethod
    def stop(self, timeout: float = 10.0) -> None:
        """Fails what is still live and stops; the engine closes."""

    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """Whether it takes requests now."""

    @property
    @abc.abstractmethod
    def down_reason(self) -> str | None:
        """Why it does not run (None while it does): what a client's 503 says."""

    @property
    @abc.abstractmethod
    def pid(self) -> int | None:
        """The process the engine runs in."""

    @abc.abstractmethod
    async def add(self, request_id: str, prompt: dict, params: SamplingParams) -> RequestStream:
        """The request's stream once the engine has taken it. QueueFullError, EngineStoppedError, or the engine's
        refusal (ValueError, RequestError)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stops a request (its stream ends); unknown ids are ignored."""

    @abc.abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """The engine's counts and counters as last published (requests not yet taken count as waiting)."""

    @abc.abstractmethod
    def in_flight(self) -> int:
        """Requests sent and not finished, as of now."""

    @abc.abstractmethod
    def admitted(self) -> int:
        """Of those, the ones the engine has taken."""

    @abc.abstractmethod
    def health_details(self) -> dict:
        """More lines for /health's body ({} when there is nothing to add)."""
