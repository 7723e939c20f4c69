"""An LLMEngine over several processes, as the server's engine loop drives it (rank 0) and as followers run it.

`ServedLockstepEngine` is LockstepEngine (multiprocess.py: rank 0's requests broadcast before each step) with what a
long-running server needs on top:
- a bad request is refused on rank 0 when it is added (the engine's own checks), so it never reaches a broadcast;
- finished requests are released in every process (their bookkeeping does not pile up on the followers);
- while idle, rank 0 still exchanges an empty list every `keepalive_s`, so the followers are never parked in a
  collective for long and a lost rank shows at the next exchange;
- a rank that is down (RankMonitor, or a collective that failed) raises RanksDownError: the engine cannot step
  without every rank, and the server turns that into 503s with the reason.
Everything else (tokenizer, limits, counters) is the wrapped engine's."""
from __future__ import annotations

import time

from qnext.distributed.multiprocess import LockstepEngine, is_leader


FOLLOWERS_EXIT_S = 20.0    # rank 0 waits this long at shutdown for the followers to leave jax.distributed


class RanksDownError(Exception):
    """A rank of the engine is down; the engine cannot step again (restart every rank)."""


class ServedLockstepEngine(LockstepEngine):
    def __init__(self, engine, monitor=None, keepalive_s: float = 0.5):
        """monitor: rank 0's RankMonitor (None on the followers)."""
        super().__init__(engine)
        self.monitor, self.keepalive_s = monitor, keepalive_s
        self.failure: str | None = None
        self._last_exchange = time.monotonic()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt, params=None) -> None:
        """Checks the request as the engine would (ValueError to the client), then queues it for every rank."""
        from qnext.sampling_params import SamplingParams

        params = params or SamplingParams()
        _, token_ids = self.engine.tokenize(prompt)
        self.engine.validate(token_ids, params)
        if request_id in self.engine.requests or any(op[1] == request_id for op in self._ops if op[0] == "add"):
            raise ValueError(f"request id {request_id!r} is already in use")
        super().add_request(request_id, prompt, params)

    def release(self, request_id: str) -> None:
        self._ops.append(("release", request_id))

    def has_unfinished_requests(self) -> bool:
        keepalive_due = is_leader() and time.monotonic() - self._last_exchange >= self.keepalive_s
        return super().has_unfinished_requests() or keepalive_due

    def step(self) -> list | None:
        self._raise_if_down()
        try:
            ops = self._broadcast.exchange(self._ops if is_leader() else None)
            self._ops = []
            self._last_exchange = time.monotonic()
            for op in ops:
                if op[0] == "shutdown":
                    return None
                self._apply(op)
            return self.engine.step() if self.engine.has_unfinished_requests() else []
        except Exception as e:
            self.failure = self._which_rank(1.0) or f"a collective between the ranks failed ({e})"
            raise RanksDownError(f"the engine lost a rank: {self.failure}") from e

    def _apply(self, op: tuple) -> None:
        kind, request_id = op[0], op[1]
        if kind == "add":
            try:
                self.engine.add_request(*op[1:])
            except ValueError:          # checked on rank 0 before it was queued; the same everywhere if not
                pass
        elif kind == "abort":
            self.engine.abort_request(request_id)
        elif kind == "release":
            self.engine.release(request_id)

    def close(self) -> None:
        """Rank 0: the followers stop (when every rank is still up), then the engine closes."""
        if is_leader() and self.failure is None and self._monitor_failure() is None:
            try:
                self.shutdown()
            except Exception as e:                # a rank left meanwhile: nothing to stop there
                self.failure = f"shutdown broadcast failed ({e})"
        if self.monitor is not None:
            self.monitor.close(wait_s=0.0 if self.failure else FOLLOWERS_EXIT_S)
        self.engine.close()

    def _monitor_failure(self) -> str | None:
        return self.monitor.failure() if self.monitor is not None else None

    def _which_rank(self, wait_s: float) -> str | None:
        """After a failed collective: the monitor's account of the lost rank (its heartbeat connection closes a
        moment after the collective fails), waiting up to `wait_s` for it."""
        deadline = time.monotonic() + wait_s
        while self.monitor is not None and time.monotonic() < deadline:
            if (why := self.monitor.failure()) is not None:
                return why
            time.sleep(0.02)
        return self._monitor_failure()

    def _raise_if_down(self) -> None:
        why = self.failure or self._monitor_failure()
        if why is not None:
            self.failure = why
            raise RanksDownError(f"the engine lost a rank: {why}")
