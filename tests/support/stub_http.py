"""A stub HTTP server on 127.0.0.1 (a free port, a thread per connection) for tests that need a peer that is slow,
lies, or only records what reached it. `respond(method, path, headers, body) -> (status, json-able body)`; every
request is recorded in `requests` as (method, path, headers) before `respond` runs."""
from __future__ import annotations

import contextlib
import http.server
import json
import threading
from typing import Callable, Iterator


class StubServer:
    def __init__(self, respond: Callable[[str, str, dict, bytes], tuple[int, object]]):
        self.requests: list[tuple[str, str, dict]] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _serve(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                stub.requests.append((self.command, self.path, headers))
                status, answer = respond(self.command, self.path, headers, body)
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:          # the client gave up first
                    pass

            do_GET = do_POST = _serve

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @contextlib.contextmanager
    def running(self) -> Iterator["StubServer"]:
        self._thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
