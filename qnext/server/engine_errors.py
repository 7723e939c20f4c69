"""The engine loop's errors, as the HTTP side answers them (server/errors.py: 503, 500, 429, or a RequestError's own
status)."""
from __future__ import annotations


class QueueFullError(Exception):
    """More requests are waiting than --max-waiting-requests allows."""


class EngineStepError(Exception):
    """The engine step that was running this request raised."""


class EngineStoppedError(Exception):
    """The engine loop has stopped (shutdown or a fatal error)."""


class RequestError(Exception):
    """The engine refused or failed this one request, its neighbours going on; `status` is the HTTP status it means
    (4xx: the client's request was at fault; 5xx: a peer or the server was)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status
