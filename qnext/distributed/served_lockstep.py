"""An LLMEngine over several processes, as the server's engine loop drives it (rank 0) and as followers run it.

`ServedLockstepEngine` is LockstepEngine (multiprocess.py: rank 0's requests broadcast before each step) with what a
long-running server needs on top:
- rank 0 applies each add / abort / release to its engine at once (the engine's full admission: a request it
  refuses is answered 400 and never broadcast) and queues it for the other ranks, which apply the same operations
  in the same order before the same step; a follower that refuses what rank 0 admitted has diverged from it and
  stops (RanksDivergedError), which rank 0 sees as a lost rank, so no request is left waiting;
- finished requests are released in every process (their bookkeeping does not pile up on the followers);
- while idle, rank 0 still exchanges an empty list every `keepalive_s`, so the followers are never parked in a
  collective for long and a lost rank shows at the next exchange;
- a rank that is down (RankMonitor, or a collective that failed) raises RanksDownError: the engine cannot step
  without every rank, and the server turns that into 503s with the reason.
It is a ServedEngine (qnext/served_engine.py); what rank 0 only reads (the tokenizer and limits, the streamed text,
the counters) is its own engine's, member by member."""
from __future__ import annotations

import time

from qnext.distributed.multiprocess import LockstepEngine, is_leader
from qnext.distributed.request_codec import encode_ops
from qnext.served_engine import EngineSnapshot, ServedEngine, ServedModel


FOLLOWERS_EXIT_S = 20.0    # rank 0 waits this long at shutdown for the followers to leave jax.distributed


class RanksDownError(Exception):
    """A rank of the engine is down; the engine cannot step again (restart every rank)."""


class RanksDivergedError(Exception):
    """A follower could not apply what rank 0 broadcast (a malformed broadcast, or a request rank 0's engine admitted
    and this one refuses): it no longer runs the same engine and must stop."""


class ServedLockstepEngine(LockstepEngine, ServedEngine):
    def __init__(self, engine, monitor=None, keepalive_s: float = 0.5):
        """monitor: rank 0's RankMonitor (None on the followers)."""
        super().__init__(engine)
        self.monitor, self.keepalive_s = monitor, keepalive_s
        self.failure: str | None = None
        self._last_exchange = time.monotonic()

    # ---- read on rank 0 only: its own engine's, the same as every rank's ------------------------------------------
    @property
    def served_model(self) -> ServedModel:
        return self.engine.served_model

    def running_request_ids(self) -> list[str]:
        return self.engine.running_request_ids()

    def stream_text(self, request_id: str, index: int = 0) -> str:
        return self.engine.stream_text(request_id, index)

    def status(self) -> EngineSnapshot:
        return self.engine.status()

    def take_failed_requests(self) -> list[tuple[str, Exception]]:
        return self.engine.take_failed_requests()

    # ---- the operations every rank applies ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params=None) -> None:
        """Rank 0: the engine admits the request (its ValueError goes to the client), then it is queued for the
        other ranks. A request the broadcast cannot carry is refused before the engine sees it."""
        encode_ops([("add", request_id, prompt, params)])
        self.engine.add_request(request_id, prompt, params)
        self._ops.append(("add", request_id, prompt, params))

    def abort_request(self, request_id: str):
        self._ops.append(("abort", request_id))
        return self.engine.abort_request(request_id)

    def release(self, request_id: str) -> None:
        self._ops.append(("release", request_id))
        self.engine.release(request_id)

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
                if not is_leader():          # rank 0 applied its operations when they were made
                    self._apply(op)
            return self.engine.step() if self.engine.has_unfinished_requests() else []
        except RanksDivergedError:
            raise
        except ValueError as e:
            if is_leader():
                raise
            raise RanksDivergedError(f"rank 0's request broadcast could not be read ({e})") from e
        except Exception as e:
            self.failure = self._which_rank(1.0) or f"a collective between the ranks failed ({e})"
            raise RanksDownError(f"the engine lost a rank: {self.failure}") from e

    def _apply(self, op: tuple) -> None:
        kind, request_id = op[0], op[1]
        if kind == "add":
            try:
                self.engine.add_request(*op[1:])
            except ValueError as e:
                raise RanksDivergedError(f"this rank refused request {request_id!r}, which rank 0 admitted ({e}); "
                                         "the ranks no longer run the same engine") from e
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
