"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status that goes with it."""
from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from qnext.server.api_shapes import anthropic_error_body, is_anthropic_path
from qnext.server.engine_errors import EngineStepError, EngineStoppedError, QueueFullError, RequestError

logger = logging.getLogger("qnext.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        """In the shape of the API `path` belongs to (Anthropic's on /v1/messages, else OpenAI's)."""
        body = anthropic_error_body(self.status, self.message) if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


RETRY_AFTER_SECONDS = 1


def engine_error(e: Exception) -> APIError:
    """What the engine loop raised (on admission, or later in a running request) as the HTTP error it means."""
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), type="server_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, EngineStoppedError):
        return APIError(503, str(e), type="server_error", code="engine_stopped")
    if isinstance(e, RequestError):
        return APIError(e.status, str(e), type="invalid_request_error" if e.status < 500 else "server_error")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), type="server_error", code="engine_step_failed")
    if isinstance(e, ValueError):                  # anything add_request still refuses
        return bad_request(str(e))
    raise TypeError(f"not an engine error: {e!r}") from e


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """Every problem pydantic found, as one 400 naming the fields."""
    problems, params = [], []
    for err in e.errors():
        loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        params.append(loc or None)
        problems.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return bad_request("invalid request: " + "; ".join(problems), params[0] if params else None)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] = lambda status: None) -> None:
    """Every error leaves in its route's API shape; on_error(status) is told of each (metrics). The server's log
    says why (the access log only has the status): 4xx at info, 5xx at warning."""
    def respond(e: APIError, request: Request):
        on_error(e.status)
        logger.log(logging.WARNING if e.status >= 500 else logging.INFO, "%s %s -> %d: %s", request.method,
                   request.url.path, e.status, e.message[:1000])
        return e.response(request.url.path)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return respond(e, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return respond(from_validation_error(e), request)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return respond(APIError(e.status_code, str(e.detail), type=kind, headers=e.headers), request)
