"""Which API a path belongs to, and an error body in that API's shape.

Anthropic routes (`/v1/messages...`) answer `{"type": "error", "error": {"type", "message"}}`; every other route
answers OpenAI's `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

from fastapi.responses import JSONResponse

ANTHROPIC_PREFIX = "/v1/messages"

# HTTP status -> Anthropic's error type (docs.anthropic.com, "Errors")
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def openai_error_body(status: int, message: str, type: str | None = None, param: str | None = None,
                      code: str | None = None) -> dict:
    kind = type or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(path: str, status: int, message: str, *, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An error for `path` in its API's shape (for middleware, before any route runs)."""
    if is_anthropic_path(path):
        body = anthropic_error_body(status, message)
    else:
        kind = "authentication_error" if status == 401 else None
        body = openai_error_body(status, message, kind, code=code)
    return JSONResponse(body, status_code=status, headers=headers)
