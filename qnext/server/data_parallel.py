"""Data parallelism in the server (`qnext serve --data-parallel-size N`): N engine replicas behind one HTTP app,
each with its own engine thread (AsyncEngine), cache and metrics, and a router in front of them.

Cache-aware routing (SGLang's router, vLLM's prefix-aware routing) is the server's one prefix affinity router
(prefix_affinity.py): its keys are the chained block hashes (cache/hashing.py, the engine's own) of what was sent to
a replica and what came back (prompt + reply: the next chat turn's prefix), at most the replica's KV blocks of them.
A request goes to the replica holding the longest run of its leading block hashes; with no match, or a tie, to the
least loaded (its requests in flight: sent and not yet finished). `round_robin` is there to compare against.
A replica whose waiting queue is full passes the request to the next best one, so every request is answered
while any replica has room. Replicas are threads of this process (`--data-parallel-backend thread`) or processes of
their own (`process`, the default: replica_process.py; no replica's host work waits on another's GIL); a replica
that is down is skipped, and the requests it held fail with a 503 that names it. A block holding a picture's pads
is keyed on the picture's content hash, as the engine's cache keys it, so prompts with the same text and other
pictures share only the blocks before the picture (a process replica runs the tower; the HTTP process only
preprocesses). The router's table is what was sent, not what the replica kept: a replica may have
evicted a block since; it then recomputes it, as a single engine would.
"""
from __future__ import annotations

import asyncio

from typing import Sequence

from cache.hashing import block_hashes
from cache.image_keys import ImageSpan
from qnext.engine.visual_intake import visual_prompt
from qnext.lora.identity import adapter_hash_root
from qnext.sampling_params import SamplingParams
from qnext.served_engine import EngineSnapshot, ServedEngine, ServedModel
from qnext.server.engine_front import EngineFront
from qnext.server.engine_errors import EngineStoppedError, QueueFullError
from qnext.server.engine_loop import AsyncEngine
from qnext.server.merged_metrics import MergedMetrics
from qnext.server.metrics import ServerMetrics
from qnext.server.prefix_affinity import PrefixAffinity
from qnext.server.request_stream import RequestStream

BACKENDS = ("process", "thread")


def prompt_chain(model: ServedModel, token_ids: list[int], images: Sequence[ImageSpan] = (),
                 root: bytes | None = None) -> list[bytes]:
    """The router's keys for a prompt: its full blocks' chained hashes, a picture's blocks keyed on the picture as
    the engine's cache keys them (cache/image_keys.py), rooted at its LoRA adapter's digest (qnext/lora/identity.py)."""
    return block_hashes(token_ids, model.block_size, images=images, root=root)


class ReplicaLoop(AsyncEngine):
    """A replica's engine thread, run under the `jax.default_device` its engine was loaded and warmed up under:
    the device is part of jit's cache key, so stepping outside it would compile every step shape again."""

    def __init__(self, engine: ServedEngine, device, **kwargs):
        super().__init__(engine, **kwargs)
        self._device = device

    def _run(self) -> None:
        import jax

        with jax.default_device(self._device):
            super()._run()


class _ReplicaObserver:
    """The replica's metrics observer, plus: a finished request's prompt + reply recorded in the router."""

    def __init__(self, dp: "DataParallelEngine", metrics: ServerMetrics, replica: int):
        self.dp, self.metrics, self.replica = dp, metrics, replica

    def on_first_token(self, stream) -> None:
        self.metrics.on_first_token(stream)

    def on_finish(self, stream, out) -> None:
        self.metrics.on_finish(stream, out)
        self.dp._owner.pop(out.request_id, None)
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        images, root = self.dp._images.pop(out.request_id, ((), None))
        self.dp.router.record(self.replica, prompt_chain(self.dp.served_model, tokens, images, root))


class DataParallelEngine(EngineFront):
    """An EngineFront over N replicas (EngineFronts themselves: ReplicaLoop threads or ProcessReplicas)."""

    def __init__(self, replicas: list[EngineFront], *, model_name: str, routing: str = "cache_aware"):
        """Each replica gets its metrics observer here (`observer`, before it starts)."""
        if not replicas:
            raise ValueError("data parallelism needs at least one engine replica")
        self._served_model = replicas[0].served_model     # the same model everywhere
        self.router = PrefixAffinity(len(replicas), self._served_model.num_blocks, load_of=self._load,
                                     policy=routing)
        self.replicas = list(replicas)
        self.metrics: list[ServerMetrics] = []
        # request id -> (its replica, its stream: None while being admitted), until it finishes, fails or is closed
        self._owner: dict[str, tuple[EngineFront, RequestStream | None]] = {}
        # request id -> (its pictures' spans, its LoRA adapter's root), until it finishes
        self._images: dict[str, tuple[tuple[ImageSpan, ...], bytes | None]] = {}
        for i, replica in enumerate(self.replicas):
            metrics = ServerMetrics(replica.snapshot, model_name, labels={"engine": str(i)})
            replica.observer = _ReplicaObserver(self, metrics, i)
            self.metrics.append(metrics)
        self.routed = [0] * len(replicas)     # requests sent to each replica
        self.server_metrics = MergedMetrics(self.metrics)

    @classmethod
    def of_threads(cls, engines: list[ServedEngine], *, max_waiting_requests: int, model_name: str,
                   routing: str = "cache_aware", devices: list | None = None) -> "DataParallelEngine":
        """A thread per engine in this process. devices: each replica's jax.default_device (its first device), None:
        the default."""
        loops = [ReplicaLoop(e, devices[i] if devices else None, max_waiting_requests=max_waiting_requests)
                 for i, e in enumerate(engines)]
        return cls(loops, model_name=model_name, routing=routing)

    def _load(self, i: int) -> int:
        return self.replicas[i].in_flight()

    @property
    def served_model(self) -> ServedModel:
        return self._served_model

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def stop(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.stop(timeout)

    @property
    def is_running(self) -> bool:
        """While any replica serves (a replica that is down is skipped by the router)."""
        return any(r.is_running for r in self.replicas)

    @property
    def down_reason(self) -> str | None:
        return None if self.is_running else "; ".join(r.down_reason or "" for r in self.replicas)

    @property
    def pid(self) -> int | None:
        return self.replicas[0].pid if len({r.pid for r in self.replicas}) == 1 else None

    def health_details(self) -> dict:
        """/health's per-replica lines."""
        return {"replicas_up": sum(r.is_running for r in self.replicas),
                "replicas": [{"index": i, "up": r.is_running, "pid": r.pid, "in_flight": r.in_flight(),
                              "admitted": r.admitted()} for i, r in enumerate(self.replicas)]}

    def snapshot(self) -> EngineSnapshot:
        snaps = [r.snapshot() for r in self.replicas]
        return EngineSnapshot(num_running=sum(s.num_running for s in snaps),
                              num_waiting=sum(s.num_waiting for s in snaps))

    def in_flight(self) -> int:
        return sum(r.in_flight() for r in self.replicas)

    def admitted(self) -> int:
        return sum(r.admitted() for r in self.replicas)

    def abort(self, request_id: str) -> None:
        owner = self._owner.get(request_id)
        if owner is not None:
            owner[0].abort(request_id)

    def _forget_ended(self) -> None:
        """Drops the bookkeeping of requests that ended without on_finish (a step failed, the replica died, the
        client left): their streams say finished once read to the end or closed."""
        for request_id, (_, stream) in list(self._owner.items()):
            if stream is not None and stream.finished:
                self._owner.pop(request_id, None)
                self._images.pop(request_id, None)

    async def add(self, request_id: str, prompt: dict, params: SamplingParams) -> RequestStream:
        self._forget_ended()
        images = self._picture_spans(prompt)
        lora = prompt.get("lora_request")
        root = await asyncio.to_thread(adapter_hash_root, lora) if lora is not None else None
        chain = prompt_chain(self._served_model, list(prompt["prompt_token_ids"]), images, root)
        if images or root:
            self._images[request_id] = (images, root)    # before it is sent: it may finish before add returns
        error: Exception | None = None
        for i in self.router.order(chain):
            replica = self.replicas[i]
            if not replica.is_running:
                error = error or EngineStoppedError(replica.down_reason)
                continue
            self._owner[request_id] = (replica, None)   # before it is sent: it may finish before add returns
            try:
                stream = await replica.add(request_id, prompt, params)
            except (QueueFullError, EngineStoppedError) as e:      # full or down: the next best one
                self._owner.pop(request_id, None)
                error = e if error is None or isinstance(e, QueueFullError) else error
                continue
            except BaseException:
                self._owner.pop(request_id, None)
                raise
            if request_id in self._owner:                  # not finished already (on_finish drops it)
                self._owner[request_id] = (replica, stream)
            self.routed[i] += 1
            self.router.sent(i, chain)
            return stream
        self._images.pop(request_id, None)
        raise error

    def _picture_spans(self, prompt: dict) -> tuple[ImageSpan, ...]:
        """Where the prompt's pictures lie, with their content hashes (() for a text prompt): the router keys
        their blocks on them, so prompts with the same text and other pictures do not share those blocks."""
        if not prompt.get("multi_modal_data"):
            return ()
        _, _, visuals = visual_prompt(prompt, None, self._served_model.vision)
        return visuals.spans if visuals is not None else ()

    def render_metrics(self) -> bytes:
        """Every replica's metrics in one exposition, each sample labelled engine="i"."""
        return self.server_metrics.render()
