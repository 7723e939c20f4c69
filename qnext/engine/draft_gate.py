"""Per-request switch for host drafting (suffix / n-gram): a request whose drafts are rarely kept stops drafting, so
text that does not repeat (chat) runs plain decoding's steps and pays no verify window for drafts that fail.

Each verify step a request drafted in adds (drafted, kept) to its last `patience` records; when they are full and
kept / drafted < min_acceptance, the request drafts nothing for `backoff` of its steps (the backoff doubles each
time, up to max_backoff), then tries again: an agent's turn can move from prose to copying a file."""
from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class _Record:
    history: collections.deque
    steps: int = 0              # the request's steps so far (proposals asked)
    off_until: int = 0          # no drafts before this step
    backoff: int = 0


class AcceptanceGate:
    def __init__(self, min_acceptance: float = 0.25, patience: int = 8, backoff: int = 32, max_backoff: int = 1024):
        if not 0 <= min_acceptance <= 1 or patience < 1 or backoff < 1 or max_backoff < backoff:
            raise ValueError(f"bad acceptance gate: min_acceptance {min_acceptance} (in [0, 1]), patience {patience} "
                             f"(>= 1), backoff {backoff} (>= 1), max_backoff {max_backoff} (>= backoff)")
        self.min_acceptance, self.patience = min_acceptance, patience
        self.initial_backoff, self.max_backoff = backoff, max_backoff
        self._records: dict[str, _Record] = {}
        self.num_turned_off = 0       # times a request was switched off (for tests and stats)

    def _record(self, request_id: str) -> _Record:
        rec = self._records.get(request_id)
        if rec is None:
            rec = self._records[request_id] = _Record(collections.deque(maxlen=self.patience),
                                                      backoff=self.initial_backoff)
        return rec

    def record(self, request_id: str, drafted: int, kept: int) -> None:
        """A verify step in which the request had `drafted` drafts and kept `kept` of them."""
        if drafted <= 0:
            return
        rec = self._record(request_id)
        rec.history.append((drafted, kept))
        if len(rec.history) == self.patience:
            total = sum(d for d, _ in rec.history)
            if sum(k for _, k in rec.history) < self.min_acceptance * total:
                rec.off_until = rec.steps + rec.backoff
                rec.backoff = min(2 * rec.backoff, self.max_backoff)
                rec.history.clear()
                self.num_turned_off += 1

    def allows(self, request_id: str) -> bool:
        """Whether the request drafts this step (counts the step)."""
        rec = self._record(request_id)
        rec.steps += 1
        return rec.steps > rec.off_until

    def free(self, request_id: str) -> None:
        self._records.pop(request_id, None)
