"""Data parallelism in the server (`qnext serve --data-parallel-size N`): N engine replicas behind one HTTP app,
each with its own engine thread (AsyncEngine), cache and metrics, and a router in front of them.

Cache-aware routing (SGLang's router, vLLM's prefix-aware routing): the router keeps, per replica, the chained
block hashes (cache/hashing.py, the engine's own) of what it sent there and what came back (prompt + reply: the
next chat turn's prefix), bounded by the replica's KV blocks (least recently used dropped first). A request goes
to the replica holding the longest run of its leading block hashes; with no match, or a tie, to the least loaded
(its requests in flight: sent and not yet finished). `round_robin` is there to compare against.
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
import collections
import itertools
import threading
from typing import Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from cache.hashing import block_hashes
from cache.image_keys import ImageSpan
from qnext.engine.visual_intake import visual_prompt
from qnext.lora.identity import adapter_hash_root
from qnext.server.engine_loop import AsyncEngine, EngineSnapshot, EngineStoppedError, QueueFullError
from qnext.server.metrics import ServerMetrics, cache_usage

ROUTING = ("cache_aware", "round_robin")
BACKENDS = ("process", "thread")


class PrefixRouter:
    """Picks a replica for a prompt's token ids (thread-safe)."""

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, policy: str = "cache_aware",
                 load_of=lambda i: 0):
        if policy not in ROUTING:
            raise ValueError(f"routing policy must be one of {ROUTING}, got {policy!r}")
        self.num_replicas, self.block_size, self.policy = num_replicas, block_size, policy
        self.capacity_blocks, self._load_of = capacity_blocks, load_of
        self._held = [collections.OrderedDict() for _ in range(num_replicas)]   # hash -> None, LRU order
        self._next = itertools.count()
        self._lock = threading.Lock()

    def matched_blocks(self, replica: int, hashes: list[bytes]) -> int:
        held = self._held[replica]
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def order(self, token_ids: list[int], images: Sequence[ImageSpan] = (), root: bytes | None = None) -> list[int]:
        """Replicas best first: the longest cached prefix, then the least loaded (round robin: in turn). images: the
        prompt's pictures, keyed into the block hashes as the engine's cache keys them (cache/image_keys.py); root:
        its LoRA adapter's digest root, as the engine's cache keys it (qnext/lora/identity.py)."""
        if self.policy == "round_robin":
            first = next(self._next) % self.num_replicas
            return [(first + i) % self.num_replicas for i in range(self.num_replicas)]
        hashes = block_hashes(token_ids, self.block_size, images=images, root=root)
        with self._lock:
            matched = [self.matched_blocks(i, hashes) for i in range(self.num_replicas)]
        loads = [self._load_of(i) for i in range(self.num_replicas)]
        return sorted(range(self.num_replicas), key=lambda i: (-matched[i], loads[i], i))

    def record(self, replica: int, token_ids: list[int], images: Sequence[ImageSpan] = (),
               root: bytes | None = None) -> None:
        """`replica` now holds the full blocks of token_ids (a prompt sent, or prompt + reply finished)."""
        if self.policy == "round_robin":
            return
        hashes = block_hashes(token_ids, self.block_size, images=images, root=root)
        with self._lock:
            held = self._held[replica]
            for h in hashes:
                held[h] = None
                held.move_to_end(h)
            while len(held) > self.capacity_blocks:
                held.popitem(last=False)


class _ReplicaLoop(AsyncEngine):
    """A replica's engine thread, run under the `jax.default_device` its engine was loaded and warmed up under:
    the device is part of jit's cache key, so stepping outside it would compile every step shape again."""

    def __init__(self, engine, device, **kwargs):
        super().__init__(engine, **kwargs)
        self._device = device

    def _run(self) -> None:
        import jax

        with jax.default_device(self._device):
            super()._run()


class _ReplicaObserver:
    """The replica's metrics observer, plus: a finished request's prompt + reply recorded in the router."""

    def __init__(self, metrics: ServerMetrics, router: PrefixRouter, replica: int, owners: dict, images: dict):
        self.metrics, self.router, self.replica, self.owners, self.images = metrics, router, replica, owners, images

    def on_first_token(self, stream) -> None:
        self.metrics.on_first_token(stream)

    def on_finish(self, stream, out) -> None:
        self.metrics.on_finish(stream, out)
        self.owners.pop(out.request_id, None)
        self.router.record(self.replica, list(out.prompt_token_ids) + list(out.outputs[0].token_ids),
                           *self.images.pop(out.request_id, ((), None)))


class DataParallelEngine:
    """AsyncEngine's interface (add, abort, snapshot, start, stop, is_running, engine) over N replicas."""

    def __init__(self, engines: list, *, max_waiting_requests: int, model_name: str, routing: str = "cache_aware",
                 devices: list | None = None, replicas: list | None = None):
        """devices: each replica's jax.default_device (its first device), None: the default. replicas: replicas
        already running elsewhere (ProcessReplica, with AsyncEngine's interface) instead of a thread per engine;
        `engines` then only describe them (block size, KV blocks, tokenizer)."""
        if not engines:
            raise ValueError("data parallelism needs at least one engine replica")
        first = engines[0]
        capacity = first.cache_sizes.num_blocks if hasattr(first, "cache_sizes") else 1 << 16
        self.router = PrefixRouter(len(engines), first.config.block_size, capacity, routing,
                                   load_of=self._load)
        self.replicas: list[AsyncEngine] = []
        self.metrics: list[ServerMetrics] = []
        # request id -> (its replica, its stream: None while being admitted), until it finishes, fails or is closed
        self._owner: dict[str, tuple[AsyncEngine, object]] = {}
        # request id -> (its pictures' spans, its LoRA adapter's root), until it finishes
        self._images: dict[str, tuple[tuple[ImageSpan, ...], bytes | None]] = {}
        for i, engine in enumerate(engines):
            holder: list[AsyncEngine] = []
            metrics = ServerMetrics(lambda h=holder: h[0].snapshot(), model_name, labels={"engine": str(i)})
            observer = _ReplicaObserver(metrics, self.router, i, self._owner, self._images)
            if replicas is not None:
                replica = replicas[i]
                replica.observer = observer
            else:
                replica = _ReplicaLoop(engine, devices[i] if devices else None,
                                       max_waiting_requests=max_waiting_requests, observer=observer,
                                       usage_of=cache_usage)
            holder.append(replica)
            self.replicas.append(replica)
            self.metrics.append(metrics)
        self.engine = first                   # the tokenizer and limits the HTTP side reads (same model everywhere)
        self.routed = [0] * len(engines)      # requests sent to each replica
        self.server_metrics = _MergedMetrics(self)

    def _load(self, i: int) -> int:
        return self.replicas[i].in_flight()

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

    def health_details(self) -> dict:
        """/health's per-replica lines."""
        return {"replicas_up": sum(r.is_running for r in self.replicas),
                "replicas": [{"index": i, "up": r.is_running, "pid": getattr(r, "pid", None),
                              "in_flight": r.in_flight(), "admitted": r.admitted()}
                             for i, r in enumerate(self.replicas)]}

    def snapshot(self) -> EngineSnapshot:
        snaps = [r.snapshot() for r in self.replicas]
        return EngineSnapshot(num_running=sum(s.num_running for s in snaps),
                              num_waiting=sum(s.num_waiting for s in snaps))

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

    async def add(self, request_id: str, prompt: dict, params):
        self._forget_ended()
        token_ids = list(prompt["prompt_token_ids"])
        images = self._picture_spans(prompt)
        lora = prompt.get("lora_request")
        root = await asyncio.to_thread(adapter_hash_root, lora) if lora is not None else None
        if images or root:
            self._images[request_id] = (images, root)    # before it is sent: it may finish before add returns
        error: Exception | None = None
        for i in self.router.order(token_ids, images, root):
            if not self.replicas[i].is_running:
                error = error or EngineStoppedError(getattr(self.replicas[i], "down", None)
                                                    or f"data parallel replica {i} is not running")
                continue
            self._owner[request_id] = (self.replicas[i], None)   # before it is sent: it may finish before add returns
            try:
                stream = await self.replicas[i].add(request_id, prompt, params)
            except (QueueFullError, EngineStoppedError) as e:      # full or down: the next best one
                self._owner.pop(request_id, None)
                error = e if error is None or isinstance(e, QueueFullError) else error
                continue
            except BaseException:
                self._owner.pop(request_id, None)
                raise
            if request_id in self._owner:                  # not finished already (on_finish drops it)
                self._owner[request_id] = (self.replicas[i], stream)
            self.routed[i] += 1
            self.router.record(i, token_ids, images, root)
            return stream
        self._images.pop(request_id, None)
        raise error

    def _picture_spans(self, prompt: dict) -> tuple[ImageSpan, ...]:
        """Where the prompt's pictures lie, with their content hashes (() for a text prompt): the router keys
        their blocks on them, so prompts with the same text and other pictures do not share those blocks."""
        if not prompt.get("multi_modal_data"):
            return ()
        _, _, visuals = visual_prompt(prompt, None, self.engine.vision)
        return visuals.spans if visuals is not None else ()

    def render_metrics(self) -> bytes:
        """Every replica's metrics in one exposition, each sample labelled engine="i"."""
        registry = CollectorRegistry()
        registry.register(_MergedCollector([m.registry for m in self.metrics]))
        return generate_latest(registry)


class _MergedMetrics:
    """What the app asks of its metrics: HTTP errors counted (on replica 0's registry), and the exposition."""

    def __init__(self, dp: DataParallelEngine):
        self._dp = dp

    def count_error(self, status: int) -> None:
        self._dp.metrics[0].count_error(status)

    def render(self) -> bytes:
        return self._dp.render_metrics()


class _MergedCollector:
    def __init__(self, registries):
        self._registries = registries

    def collect(self):
        merged: dict[str, Metric] = {}
        for registry in self._registries:
            for family in registry.collect():
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name].samples.extend(family.samples)
        yield from merged.values()


def build_replicas(model, engine_options: dict, args, model_name: str):
    """`qnext serve --data-parallel-size N`: N engines, replica i on the devices from i * tensor_parallel_size
    (jax.default_device while it loads: qnext.model.host_devices.engine_devices) -> (the first engine, the
    DataParallelEngine, its metrics), for build_app."""
    import logging

    logger = logging.getLogger("qnext.server")
    if getattr(args, "data_parallel_backend", "thread") == "process":
        return _build_process_replicas(model, engine_options, args, model_name, logger)
    import jax

    import qnext
    tp = engine_options.get("tensor_parallel_size") or 1
    devices = jax.devices()
    if len(devices) < args.data_parallel_size * tp:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} x tensor_parallel_size {tp} needs "
                         f"{args.data_parallel_size * tp} devices; JAX sees {len(devices)}")
    engines = []
    for i in range(args.data_parallel_size):
        with jax.default_device(devices[i * tp]):
            logger.info("replica %d on devices %d..%d", i, i * tp, (i + 1) * tp - 1)
            engines.append(qnext.LLM(model, warm_up=not args.no_warm_up, progress=logger.info,
                                     **engine_options).engine)
    dp = DataParallelEngine(engines, max_waiting_requests=args.max_waiting_requests, model_name=model_name,
                            routing=args.data_parallel_routing,
                            devices=[devices[i * tp] for i in range(args.data_parallel_size)])
    return engines[0], dp, dp.server_metrics


def _build_process_replicas(model, engine_options: dict, args, model_name: str, logger):
    """A process per replica (replica_worker.py), each on its own devices (replica_devices.py: it refuses to start
    on others); the tokenizer is loaded here for the HTTP side."""
    from pathlib import Path

    from qnext.engine.visual_intake import vision_setup
    from qnext.server.replica_devices import assign_replica_devices
    from qnext.server.replica_process import ProcessReplica, facade
    from qnext.tokenizer import Tokenizer

    assignments = assign_replica_devices(args.data_parallel_size, engine_options.get("tensor_parallel_size") or 1)
    replicas = [ProcessReplica(devices, model, engine_options, max_waiting_requests=args.max_waiting_requests,
                               warm_up=not args.no_warm_up, log_level=args.log_level) for devices in assignments]
    try:
        infos = [r.wait_ready(timeout=3600) for r in replicas]
    except BaseException:
        for r in replicas:
            r.stop(timeout=5)
        raise
    for r, info in zip(replicas, infos):
        logger.info("replica %d ready (pid %d)", r.index, info["pid"])
    tokenizer = Tokenizer.from_pretrained(model) if (Path(model) / "tokenizer.json").is_file() else None
    vision = vision_setup(model, None, preprocess_only=True) if infos[0]["vision"] else None
    engines = [facade(info, tokenizer, vision) for info in infos]
    dp = DataParallelEngine(engines, max_waiting_requests=args.max_waiting_requests, model_name=model_name,
                            routing=args.data_parallel_routing, replicas=replicas)
    return engines[0], dp, dp.server_metrics
