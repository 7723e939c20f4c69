"""The server's app in a thread of this process (uvicorn on a free loopback port), for tests that drive an engine
they built themselves."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import uvicorn


@contextlib.contextmanager
def serve_in_thread(app, start_timeout: float = 60.0, stop_timeout: float = 30.0) -> Iterator[str]:
    """Serves `app` on 127.0.0.1 until the block exits; yields the base URL (http://127.0.0.1:PORT). Raises if the
    server does not start within start_timeout or does not stop within stop_timeout."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(stop_timeout)
        if thread.is_alive():
            raise RuntimeError("the in-process server did not stop")
