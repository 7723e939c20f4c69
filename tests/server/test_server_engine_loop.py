"""The engine loop (qnext/server/engine_loop.py) over a fake engine: no model, milliseconds per test."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from qnext.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qnext.sampling_params import SamplingParams
from qnext.served_engine import EngineSnapshot, ServedEngine, ServedModel
from qnext.server.engine_errors import EngineStepError, EngineStoppedError, QueueFullError, RequestError
from qnext.server.engine_loop import AsyncEngine


@dataclasses.dataclass
class _Stats:
    num_steps: int = 0


class FakeEngine(ServedEngine):
    """One token (the step number) per live request per step; `max_tokens` of them, then finished. A request
    waits until its first token."""

    def __init__(self):
        self.tokenizer = None
        self.requests: dict[str, dict] = {}
        self.stats, self.cache_stats = _Stats(), _Stats()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_at_step: int | None = None      # step number that raises instead of running
        self.fail_request: tuple | None = None     # (request id, error): that request alone fails after 2 tokens
        self._failed: list = []

    def add_request(self, request_id, prompt, params):
        if not prompt["prompt_token_ids"]:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = {"params": params, "tokens": [], "finished": None}

    def step(self):
        self.gate.wait(10)
        if self.fail_at_step == self.stats.num_steps + 1:
            self.fail_at_step = None
            raise RuntimeError("injected")
        self.stats.num_steps += 1
        outputs = []
        for rid, r in self.requests.items():
            if r["finished"] is None:
                r["tokens"].append(self.stats.num_steps)
                if self.fail_request is not None and self.fail_request[0] == rid and len(r["tokens"]) == 2:
                    self._failed.append(self.fail_request)
                if len(r["tokens"]) == r["params"].max_tokens:
                    r["finished"] = "length"
                outputs.append(self._output(rid))
        return outputs

    def _output(self, rid):
        r = self.requests[rid]
        completion = CompletionOutput(0, "", list(r["tokens"]), None, None, r["finished"])
        return RequestOutput(rid, None, [1], [completion], r["finished"] is not None, 0, RequestMetrics(0.0))

    def take_failed_requests(self):
        failed, self._failed = self._failed, []
        return failed

    def abort_request(self, rid):
        if rid in self.requests and self.requests[rid]["finished"] is None:
            self.requests[rid]["finished"] = "abort"

    def release(self, rid):
        self.requests.pop(rid, None)

    def stream_text(self, rid, index=0):
        return ""

    def has_unfinished_requests(self):
        return any(r["finished"] is None for r in self.requests.values())

    def running_request_ids(self):
        return [rid for rid, r in self.requests.items() if r["finished"] is None and r["tokens"]]

    @property
    def served_model(self):
        return ServedModel(None, max_model_len=64, vocab_size=100, block_size=4, num_blocks=16)

    def status(self):
        return EngineSnapshot(self.num_running, self.num_waiting, dataclasses.asdict(self.cache_stats),
                              dataclasses.asdict(self.stats))

    def close(self):
        pass

    @property
    def num_running(self):
        return sum(r["finished"] is None and bool(r["tokens"]) for r in self.requests.values())

    @property
    def num_waiting(self):
        return sum(r["finished"] is None and not r["tokens"] for r in self.requests.values())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def prompt(ids=(1, 2)):
    return {"prompt": None, "prompt_token_ids": list(ids)}


@pytest.fixture
def loop_and_engine():
    engine = FakeEngine()
    async_engine = AsyncEngine(engine, max_waiting_requests=2)
    async_engine.start()
    yield async_engine, engine
    engine.gate.set()
    async_engine.stop()


def test_outputs_arrive_in_order_and_finished_requests_are_released(loop_and_engine):
    async_engine, engine = loop_and_engine

    async def main():
        streams = [await async_engine.add(f"r{i}", prompt(), SamplingParams(max_tokens=3)) for i in range(2)]
        return [[t for d in [d async for d in s] for t in d.token_ids] for s in streams]

    tokens = run(main())
    assert [len(t) for t in tokens] == [3, 3] and all(t == sorted(t) for t in tokens)
    assert engine.requests == {}


def test_a_rejected_request_raises_its_value_error_and_the_loop_goes_on(loop_and_engine):
    async_engine, _ = loop_and_engine

    async def main():
        with pytest.raises(ValueError, match="the prompt is empty"):
            await async_engine.add("bad", prompt(()), SamplingParams(max_tokens=2))
        return [d async for d in await async_engine.add("good", prompt(), SamplingParams(max_tokens=2))]

    assert run(main())[-1].output.finished


def test_queue_full_counts_requests_not_yet_taken_by_the_engine(loop_and_engine):
    async_engine, engine = loop_and_engine
    engine.gate.clear()

    async def main():
        first = asyncio.ensure_future(async_engine.add("a", prompt(), SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.2)           # taken by the engine thread, which now holds in step()
        second = asyncio.ensure_future(async_engine.add("b", prompt(), SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError, match="max_waiting_requests is 2"):
            await async_engine.add("c", prompt(), SamplingParams(max_tokens=1))
        engine.gate.set()
        return [[d async for d in await s] for s in (first, second)]

    assert all(out[-1].output.finished for out in run(main()))


def test_a_step_exception_fails_the_running_requests(loop_and_engine):
    async_engine, engine = loop_and_engine

    async def main():
        # the step after the request's first token raises (set before it runs: the fake engine steps in
        # microseconds, so a flag set after the first token could come after its last)
        engine.fail_at_step = engine.stats.num_steps + 2
        stream = await async_engine.add("r", prompt(), SamplingParams(max_tokens=1000))
        await stream.__anext__()
        with pytest.raises(EngineStepError, match="injected"):
            async for _ in stream:
                pass
        return [d async for d in await async_engine.add("next", prompt(), SamplingParams(max_tokens=2))]

    assert run(main())[-1].output.finished
    assert engine.requests == {}


def test_a_request_the_engine_fails_alone_gets_its_error_and_the_others_go_on(loop_and_engine):
    async_engine, engine = loop_and_engine

    async def main():
        engine.fail_request = ("b", RequestError("the peer lied", 502))
        a = await async_engine.add("a", prompt(), SamplingParams(max_tokens=6))
        b = await async_engine.add("b", prompt(), SamplingParams(max_tokens=1000))
        with pytest.raises(RequestError, match="the peer lied") as failed:
            async for _ in b:
                pass
        return failed.value.status, [d async for d in a]

    status, deltas = run(main())
    assert status == 502 and deltas[-1].output.finished and len(deltas[-1].output.outputs[0].token_ids) == 6
    assert engine.requests == {}


async def ends_stopped(admission) -> bool:
    """True if the request was refused, or its stream failed, with EngineStoppedError."""
    try:
        async for _ in await admission:
            pass
    except EngineStoppedError:
        return True
    return False


def test_stop_fails_live_requests_and_answers_queued_ones(loop_and_engine):
    async_engine, engine = loop_and_engine
    engine.gate.clear()

    async def main():
        live = asyncio.ensure_future(async_engine.add("live", prompt(), SamplingParams(max_tokens=1000)))
        await asyncio.sleep(0.2)           # admitted; the engine thread holds in step()
        queued = asyncio.ensure_future(async_engine.add("queued", prompt(), SamplingParams(max_tokens=1000)))
        await asyncio.sleep(0.05)
        stopper = threading.Thread(target=async_engine.stop)
        stopper.start()
        engine.gate.set()
        results = [await ends_stopped(live), await ends_stopped(queued)]
        stopper.join(10)
        results.append(await ends_stopped(async_engine.add("late", prompt(), SamplingParams(max_tokens=1))))
        return results

    assert run(main()) == [True, True, True]
    assert not async_engine.is_running and engine.requests == {}
