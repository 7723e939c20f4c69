"""Rank 0's admission in a multi-rank engine (qnext/distributed/served_lockstep.py), in one process with a fake
engine: a request the engine refuses only in add_request (past tokenize and validate, e.g. pictures that do not
match the prompt's pad runs) is refused to the client at once and never broadcast, instead of being dropped on
every rank with its stream left open; a follower that refuses what rank 0 admitted stops (RanksDivergedError)."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from qnext.distributed.served_lockstep import RanksDivergedError, ServedLockstepEngine
from qnext.outputs import CompletionOutput, RequestOutput
from qnext.served_engine import EngineSnapshot, ServedEngine, ServedModel
from qnext.server.engine_loop import AsyncEngine

REFUSED = 666          # a prompt holding this token id passes tokenize + validate, and add_request refuses it


@dataclasses.dataclass
class _Counters:
    num_steps: int = 0


class PictureCheckingEngine(ServedEngine):
    """The engine surface AsyncEngine and ServedLockstepEngine use; a request finishes at its first step."""

    def __init__(self):
        self.requests: dict[str, list[int]] = {}
        self.cache_stats, self.stats = _Counters(), _Counters()
        self.num_running = self.num_waiting = 0

    def tokenize(self, prompt):
        return None, list(prompt["prompt_token_ids"])

    def validate(self, token_ids, params):
        pass

    def add_request(self, request_id, prompt, params=None):
        if REFUSED in prompt["prompt_token_ids"]:
            raise ValueError("the prompt has 2 picture pad runs and 1 picture")
        self.requests[request_id] = list(prompt["prompt_token_ids"])

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        outs = [RequestOutput(rid, None, ids, [CompletionOutput(0, "", [7], None, None, finish_reason="length")], True)
                for rid, ids in self.requests.items()]
        self.requests.clear()
        return outs

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def release(self, request_id):
        pass

    def running_request_ids(self):
        return list(self.requests)

    def stream_text(self, request_id, index=0):
        return ""

    def take_failed_requests(self):
        return []

    @property
    def served_model(self):
        return ServedModel(None, max_model_len=64, vocab_size=1000, block_size=4, num_blocks=16)

    def status(self):
        return EngineSnapshot(self.num_running, self.num_waiting)

    def close(self):
        pass


def test_a_request_the_engine_refuses_is_answered_at_once_and_never_broadcast():
    lockstep = ServedLockstepEngine(PictureCheckingEngine(), keepalive_s=60)
    async_engine = AsyncEngine(lockstep, max_waiting_requests=4)
    async_engine.start()

    async def scenario():
        with pytest.raises(ValueError, match="2 picture pad runs and 1 picture"):
            await asyncio.wait_for(async_engine.add("bad", {"prompt_token_ids": [1, REFUSED]}, None), timeout=10)
        assert lockstep._ops == []                       # nothing queued for the other ranks
        good = await asyncio.wait_for(async_engine.add("good", {"prompt_token_ids": [1, 2]}, None), timeout=10)
        deltas = [d async for d in good]
        assert deltas[-1].final and deltas[-1].token_ids == [7]

    try:
        asyncio.run(scenario())
    finally:
        async_engine.stop(timeout=5)


def test_a_follower_that_refuses_what_rank0_admitted_stops():
    follower = ServedLockstepEngine(PictureCheckingEngine())
    with pytest.raises(RanksDivergedError, match="refused request 'r', which rank 0 admitted"):
        follower._apply(("add", "r", {"prompt_token_ids": [REFUSED]}, None))
