"""The engine as a server drives it: the one interface between the server's engine loop (server/engine_loop.py) and
whatever runs the model behind it.

Implemented, each explicitly and in full, by the plain LLMEngine (engine/llm_engine.py), the two PD roles
(server/pd_role_engines.py: the prefill role exports bundles, the decode role fetches them on worker threads) and rank
0 of an engine over several processes (distributed/served_lockstep.py). A replica in another process
(server/replica_process.py) runs an LLMEngine there; the HTTP side holds only its `ServedModel`.

An abstract base class rather than a typing.Protocol: an implementation names the interface it keeps, a missing
member fails at construction (not at the first request that needs it), and a wrapper cannot pass members through by
accident: `ForwardingEngine` forwards exactly this interface's members by name, and nothing else.

It lives at the top of qnext (beside outputs.py and sampling_params.py, the vocabulary it speaks) because engine/,
distributed/ and server/ all implement or use it, and distributed/ may not import engine/ (tests/test_layering.py).

Threads: every method is called by the engine loop's one thread; `served_model` is read once, before serving, and
what it holds may be read from any thread."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

from qnext.outputs import RequestOutput
from qnext.sampling_params import SamplingParams
from qnext.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the HTTP side reads of the engine it serves (Admission, the data parallel router): fixed once the engine
    has started, the same for every replica of one model."""
    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    block_size: int                 # tokens per KV block (the router hashes prompts in these blocks)
    num_blocks: int                 # KV blocks of one replica's cache (the router remembers at most this many)
    vision: Any = None              # engine/visual_encoder.VisionSetup: the picture preprocessing (None: text only)
    check_structured: Callable[[SamplingParams], None] | None = None   # ValueError for a bad structured_outputs


@dataclasses.dataclass
class EngineSnapshot:
    """The engine's counts and counters as of the last step, for /metrics and /health."""
    num_running: int = 0
    num_waiting: int = 0
    cache_stats: dict = dataclasses.field(default_factory=dict)     # cache.CacheStats as a dict
    engine_stats: dict = dataclasses.field(default_factory=dict)    # engine/stats.EngineStats as a dict
    usage: dict = dataclasses.field(default_factory=dict)           # pool occupancy (EngineCache.usage)


class ServedEngine(abc.ABC):
    """The calls a server makes of an engine (module docstring)."""

    @property
    @abc.abstractmethod
    def served_model(self) -> ServedModel:
        """The tokenizer and limits the HTTP side reads."""

    @abc.abstractmethod
    def add_request(self, request_id: str, prompt: dict, params: SamplingParams | None = None) -> None:
        """Takes a request; ValueError (or the server's RequestError) refuses it, and the engine is unchanged."""

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a live request (None: unknown or already finished); `release` then forgets it."""

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forgets a finished or aborted request's bookkeeping."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether `step` has work (the loop blocks for commands while it has none)."""

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """One step: an output for every request that produced a token or finished."""

    @abc.abstractmethod
    def take_failed_requests(self) -> list[tuple[str, Exception]]:
        """Requests that failed alone since the last call (a PD transfer, say), with the error each client gets;
        their neighbours go on. Read by the loop after each step."""

    @abc.abstractmethod
    def running_request_ids(self) -> list[str]:
        """The requests a failing step was running (they fail with it)."""

    @abc.abstractmethod
    def stream_text(self, request_id: str, index: int = 0) -> str:
        """Text of sample `index` generated since the last call (streaming)."""

    @abc.abstractmethod
    def status(self) -> EngineSnapshot:
        """Counts, counters and pool usage now."""

    @abc.abstractmethod
    def close(self) -> None:
        """The loop has stopped: write what persists (the prefix cache), stop what the engine started. Idempotent."""


class ForwardingEngine(ServedEngine):
    """An engine over another one (`inner`), forwarding each member of ServedEngine by name, nothing more: a
    subclass overrides what it changes, and whatever else the inner engine has stays out of reach."""

    def __init__(self, inner: ServedEngine):
        self.inner = inner

    @property
    def served_model(self) -> ServedModel:
        return self.inner.served_model

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams | None = None) -> None:
        self.inner.add_request(request_id, prompt, params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.inner.abort_request(request_id)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.inner.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return self.inner.step()

    def take_failed_requests(self) -> list[tuple[str, Exception]]:
        return self.inner.take_failed_requests()

    def running_request_ids(self) -> list[str]:
        return self.inner.running_request_ids()

    def stream_text(self, request_id: str, index: int = 0) -> str:
        return self.inner.stream_text(request_id, index)

    def status(self) -> EngineSnapshot:
        return self.inner.status()

    def close(self) -> None:
        self.inner.close()
