"""A request body limit, enforced while the body is read: a declared Content-Length past the limit is answered
413 before any of the body is read; a body without one (chunked) is counted as it arrives and refused with 413
as soon as it passes the limit, so a huge body never sits in memory."""
from __future__ import annotations

from starlette.exceptions import HTTPException

from qnext.server.api_shapes import error_response

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
_CLOSE = {"Connection": "close"}       # the unread rest of a refused body is not drained


def _content_length(scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"the request body limit must be at least 1 byte, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    def _message(self, size: str) -> str:
        return f"the request body is {size}; this server accepts at most {self.max_bytes} bytes (--max-request-bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            response = error_response(scope["path"], 413, self._message(f"{length} bytes"),
                                      code="request_too_large", headers=_CLOSE)
            return await response(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:      # the app's error handlers answer it in the route's shape
                    raise HTTPException(413, self._message(f"over {self.max_bytes} bytes"), headers=_CLOSE)
            return message

        await self.app(scope, counted_receive, send)
