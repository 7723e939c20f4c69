"""Rank 0's view of the other ranks, without JAX (qnext/distributed/rank_heartbeat.py, qnext/server/rank_gate.py,
qnext/server/multinode.watch_ranks): followers counted from their handshake, a silent follower down after the
timeout and a closed one at once, the gate's 503s saying why, and requests in flight failed even when the engine
thread is stuck in a step that waits for the lost rank (a hung follower)."""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import httpx
import pytest

from qnext.distributed.rank_handshake import RankCredentials, introduce
from qnext.distributed.rank_heartbeat import RankMonitor
from qnext.served_engine import EngineSnapshot, ServedEngine, ServedModel
from qnext.server.engine_errors import EngineStoppedError
from qnext.server.engine_loop import AsyncEngine
from qnext.server.launch import free_port
from qnext.server.multinode import watch_ranks
from qnext.server.rank_gate import RankGate


CREDENTIALS = RankCredentials(identity="ckpt-a", options={"max_num_seqs": 4}, secret=None)


def follower_socket(port: int, rank: int, credentials: RankCredentials = CREDENTIALS) -> socket.socket:
    """A follower's heartbeat connection, past the handshake."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    introduce(s, rank, credentials)
    return s


def wait_for(condition, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - start


def test_the_monitor_counts_followers_and_finds_silent_and_closed_ones():
    port = free_port()
    monitor = RankMonitor(3, ("127.0.0.1", port), timeout_s=0.6, credentials=CREDENTIALS)
    try:
        assert monitor.ranks_up == 1 and monitor.missing() == [1, 2] and monitor.failure() is None
        assert monitor.wait_for_all(0.2) == [1, 2]
        one, two = follower_socket(port, 1), follower_socket(port, 2)
        wait_for(lambda: monitor.ranks_up == 3)
        assert monitor.missing() == [] and monitor.failure() is None
        for _ in range(3):                 # rank 1 keeps beating; rank 2 falls silent
            one.sendall(b".")
            time.sleep(0.25)
        took = wait_for(lambda: monitor.failure() is not None)
        assert took < 1.5 and "rank 2 of 3 sent no heartbeat for 0.6 s" in monitor.failure()
        assert monitor.ranks_up == 2
        one.close()
        wait_for(lambda: monitor.ranks_up == 1)
        assert "rank 1 of 3 closed its connection" in monitor.failure()     # the first rank down is reported
        two.close()
    finally:
        monitor.close()


@dataclasses.dataclass
class _Counters:
    num_steps: int = 0


class StuckEngine(ServedEngine):
    """The engine methods AsyncEngine uses; step() blocks until released, like a collective waiting for a rank that
    hangs."""

    def __init__(self):
        self.release_step = threading.Event()
        self.requests: list[str] = []
        self.cache_stats, self.stats = _Counters(), _Counters()
        self.num_running = self.num_waiting = 0

    def add_request(self, request_id, prompt, params):
        self.requests.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.release_step.wait(30)
        raise RuntimeError("released")

    def abort_request(self, request_id):
        self.requests.remove(request_id) if request_id in self.requests else None

    def release(self, request_id):
        pass

    def running_request_ids(self):
        return list(self.requests)

    def take_failed_requests(self):
        return []

    def stream_text(self, request_id, index=0):
        return ""

    @property
    def served_model(self):
        return ServedModel(None, max_model_len=64, vocab_size=100, block_size=4, num_blocks=16)

    def status(self):
        return EngineSnapshot(self.num_running, self.num_waiting)

    def close(self):
        pass


def test_a_hung_rank_fails_the_requests_in_flight_and_the_gate_answers_503():
    port = free_port()
    monitor = RankMonitor(2, ("127.0.0.1", port), timeout_s=0.5, credentials=CREDENTIALS)
    engine = StuckEngine()
    async_engine = AsyncEngine(engine, max_waiting_requests=4)
    gate = RankGate(monitor, 2)

    async def scenario():
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://rank0") as client:
            starting = await client.get("/health")
            assert starting.status_code == 503 and starting.json()["message"] == \
                "starting: 1 of 2 ranks up (waiting for rank 1)"
            refused = await client.post("/v1/chat/completions", json={})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "starting"
            follower = follower_socket(port, 1)
            await asyncio.to_thread(wait_for, lambda: monitor.ranks_up == 2)
            gate.open(_NoApp(), async_engine, None)
            threading.Thread(target=watch_ranks, args=(monitor, async_engine, 0.05), daemon=True).start()
            assert (await client.get("/health")).json() == {"status": "ok", "nnodes": 2, "ranks_up": 2,
                                                            "num_requests_running": 0, "num_requests_waiting": 0}
            stream = await async_engine.add("r1", {"prompt_token_ids": [1, 2]}, None)
            lost_at = time.monotonic()      # the follower goes silent from here (its socket stays open)
            with pytest.raises(EngineStoppedError, match="rank 1 of 2 sent no heartbeat"):
                await asyncio.wait_for(stream.__anext__(), timeout=5)
            assert time.monotonic() - lost_at < 2.0
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["ranks_up"] == 1
            late = await client.post("/v1/chat/completions", json={})
            assert late.status_code == 503 and "rank 1 of 2" in late.json()["error"]["message"]
            follower.close()

    try:
        asyncio.run(scenario())
    finally:
        engine.release_step.set()
        async_engine.stop(timeout=5)
        monitor.close()


class _NoApp:
    async def __call__(self, scope, receive, send):
        raise AssertionError("the gate passed a request on while a rank was down")
