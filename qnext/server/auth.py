"""API keys: `--api-key` / QNEXT_API_KEY. Every `/v1/...` route wants the key; `/health` and `/metrics` stay open.

OpenAI routes take `Authorization: Bearer KEY`; Anthropic routes (`/v1/messages...`) take `x-api-key: KEY` or the
Bearer header (Claude Code sends either, depending on ANTHROPIC_API_KEY / ANTHROPIC_AUTH_TOKEN). Keys are compared
in constant time. A pure ASGI middleware: a refused request is answered before its body is read."""
from __future__ import annotations

import hmac

from qnext.server.api_shapes import error_response, is_anthropic_path

PROTECTED_PREFIX = "/v1/"


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def presented_key(scope) -> bytes | None:
    """The key the request carries, for its API (None when it carries none)."""
    auth = _header(scope, b"authorization")
    if auth is not None and auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    if is_anthropic_path(scope["path"]):
        return _header(scope, b"x-api-key")
    return None


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        key = presented_key(scope)
        if key is not None and hmac.compare_digest(key, self._key):
            return await self.app(scope, receive, send)
        where = "x-api-key or Authorization: Bearer" if is_anthropic_path(scope["path"]) else \
            "Authorization: Bearer"
        message = ("invalid API key" if key is not None else f"missing API key: send it as {where}")
        response = error_response(scope["path"], 401, message, code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
