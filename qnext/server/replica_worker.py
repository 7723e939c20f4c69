"""A data parallel replica's own process (`qnext serve --data-parallel-size N`, the process backend): one engine on
its own devices, driven by the usual AsyncEngine, talking to the HTTP process over a pipe.

Messages in (tuples, pickled by multiprocessing over a pipe between this host's processes, never over a network):
("add", request_id, prompt, params), ("abort", request_id), ("stop",).
Messages out: ("refused", message) instead of "ready" when JAX gave it other devices than assigned
(replica_devices.py), ("ready", info), ("admitted", request_id), ("rejected", request_id, kind, message),
("delta", request_id, StreamDelta), ("failed", request_id, kind, message), ("snapshot", EngineSnapshot).
`kind` names the engine-loop error class (QueueFullError, EngineStoppedError, EngineStepError, ValueError), so the
HTTP process raises the same error and answers the same status as with the engine in-process."""
from __future__ import annotations

import asyncio
import logging
import os
import threading

SNAPSHOT_EVERY_S = 0.2


def run_replica(conn, devices, model: str, engine_options: dict, warm_up: bool, log_level: str) -> None:
    """The process's target. `devices` (a ReplicaDevices): its env is applied before JAX starts, and the replica
    refuses to start ("refused", exit 2) on other devices than it names."""
    from qnext.server.replica_devices import check_replica_devices

    os.environ.update(devices.env)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s replica {devices.index} %(name)s: %(message)s")
    try:
        check_replica_devices(devices)
    except ValueError as e:
        logging.getLogger("qnext.server").error("%s", e)
        _send(conn, ("refused", str(e)))
        conn.close()
        raise SystemExit(2) from None
    try:
        asyncio.run(_serve(conn, model, engine_options, warm_up))
    except (EOFError, OSError):           # the HTTP process went away: nothing left to serve
        pass


async def _serve(conn, model: str, engine_options: dict, warm_up: bool) -> None:
    import qnext
    from qnext.server.engine_loop import AsyncEngine
    from qnext.server.startup import warm_up_with_progress

    logger = logging.getLogger("qnext.server")
    engine = qnext.LLM(model, progress=logger.info, **engine_options).engine
    if warm_up:
        warm_up_with_progress(engine)
    # the HTTP process bounds the waiting requests (it sees every replica); here any number may wait
    async_engine = AsyncEngine(engine, max_waiting_requests=1 << 30)
    async_engine.start()
    import jax

    model = engine.served_model
    conn.send(("ready", {"platform": jax.devices()[0].platform, "device_count": jax.device_count(),
                         "max_model_len": model.max_model_len, "vocab_size": model.vocab_size,
                         "block_size": model.block_size, "num_blocks": model.num_blocks,
                         "pid": os.getpid(), "vision": model.vision is not None}))
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                return

    threading.Thread(target=read, name="qnext-replica-inbox", daemon=True).start()
    snapshots = asyncio.create_task(_send_snapshots(conn, async_engine))
    tasks: set[asyncio.Task] = set()
    while True:
        message = await inbox.get()
        if message[0] == "add":
            task = asyncio.create_task(_run_request(conn, async_engine, *message[1:]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif message[0] == "abort":
            async_engine.abort(message[1])
        elif message[0] == "stop":
            break
    snapshots.cancel()
    await asyncio.to_thread(async_engine.stop)


async def _run_request(conn, async_engine, request_id: str, prompt: dict, params) -> None:
    from qnext.server.engine_errors import EngineStepError, EngineStoppedError, QueueFullError

    try:
        stream = await async_engine.add(request_id, prompt, params)
    except (QueueFullError, EngineStoppedError, EngineStepError, ValueError) as e:
        _send(conn, ("rejected", request_id, type(e).__name__, str(e)))
        return
    _send(conn, ("admitted", request_id))
    try:
        async for delta in stream:
            _send(conn, ("delta", request_id, delta))
    except (EngineStepError, EngineStoppedError) as e:
        _send(conn, ("failed", request_id, type(e).__name__, str(e)))


async def _send_snapshots(conn, async_engine) -> None:
    while True:
        _send(conn, ("snapshot", async_engine.snapshot()))
        await asyncio.sleep(SNAPSHOT_EVERY_S)


def _send(conn, message: tuple) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, OSError):      # the HTTP process is gone; the reader thread stops the loop
        pass
