"""Sending fuzz cases to a running server and judging the answers.

A case fails when the server answers 5xx, does not answer (or finish its stream) within the deadline, drops the
connection, or sends an error event inside a 200 stream (a server-side failure after the headers went out). A 4xx is
what bad input should get; 499 is the server's own note that the client left."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import httpx

from qnext.testing.api_fuzz.cases import FuzzCase

# What a stream carries when the server failed the request after its 200 headers (openai_sinks, anthropic_response,
# responses_response).
STREAM_ERROR_MARKERS = (b'"type":"server_error"', b"event: error", b"response.failed", b'"type":"api_error"')
# What the last event of a whole 200 stream carries, per API.
STREAM_ENDS = {"chat": (b"data: [DONE]",), "completions": (b"data: [DONE]",),
               "messages": (b"event: message_stop",),
               "responses": (b"event: response.completed", b"event: response.incomplete")}


@dataclasses.dataclass
class CaseResult:
    case: FuzzCase
    status: int | None          # None: no status line came back
    seconds: float
    problem: str | None = None  # why the case failed; None: it did not
    answer: str = ""            # the start of the answer's body, for the report

    @property
    def failed(self) -> bool:
        return self.problem is not None


def send(client: httpx.Client, base_url: str, case: FuzzCase, deadline_s: float) -> CaseResult:
    start = time.monotonic()
    headers = {"content-type": "application/json"} if case.body is not None else {}
    try:
        with client.stream(case.method, base_url + case.route, content=case.body, headers=headers,
                           timeout=httpx.Timeout(deadline_s)) as response:
            received, closed_early = bytearray(), True
            for chunk in response.iter_bytes():
                received += chunk
                if case.close_after is not None and len(received) >= case.close_after:
                    break                                   # the client leaves mid-answer: the with closes it
                if time.monotonic() - start > deadline_s:
                    return CaseResult(case, response.status_code, time.monotonic() - start,
                                      f"the answer was not complete after {deadline_s:.0f}s", _start(received))
            else:
                closed_early = False
            status = response.status_code
    except httpx.TimeoutException:
        return CaseResult(case, None, time.monotonic() - start, f"no answer within {deadline_s:.0f}s")
    except httpx.TransportError as e:
        return CaseResult(case, None, time.monotonic() - start, f"the connection broke: {e!r}")
    seconds = time.monotonic() - start
    answer = _start(received)
    if status >= 500:
        return CaseResult(case, status, seconds, f"status {status}", answer)
    if status == 200 and any(marker in received for marker in STREAM_ERROR_MARKERS):
        return CaseResult(case, status, seconds, "an error event inside a 200 answer", answer)
    if status == 200 and case.stream and not closed_early and not _ends_whole(case.api, received):
        return CaseResult(case, status, seconds, "a 200 stream that ended without its last event", answer)
    return CaseResult(case, status, seconds, None, answer)


def _ends_whole(api: str, stream: bytearray) -> bool:
    """The stream's last event is the API's last one."""
    events = bytes(stream).replace(b"\r\n", b"\n").strip().split(b"\n\n")
    return any(end in events[-1] for end in STREAM_ENDS.get(api, (b"",)))


def _start(received: bytearray) -> str:
    return bytes(received[:500]).decode(errors="replace")


def send_all(base_url: str, cases: list[FuzzCase], *, workers: int = 4, deadline_s: float = 60.0,
             on_result=None) -> list[CaseResult]:
    """Every case, `workers` at a time (each worker its own connection); results in the cases' order.
    on_result(result): called as each one comes back (progress)."""
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()

    def one(case: FuzzCase) -> CaseResult:
        if not hasattr(local, "client"):
            local.client = httpx.Client()
            with lock:
                clients.append(local.client)
        result = send(local.client, base_url, case, deadline_s)
        if result.failed:       # a fresh connection for the next case: uvicorn closes one after an unhandled error
            local.client.close()
            with lock:
                clients.remove(local.client)
            del local.client
        if on_result is not None:
            on_result(result)
        return result

    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, cases))
    finally:
        for client in clients:
            client.close()
