"""Start and stop a `qnext serve` subprocess on loopback (for the serving bench and the tests)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m qnext.server ARGS --host 127.0.0.1 --port PORT`, its output in `log_path`."""

    def __init__(self, args: list[str], *, port: int | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        cmd = [sys.executable, "-m", "qnext.server", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        if log is not subprocess.DEVNULL:
            log.close()

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was ready; "
                                   f"log: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the server was not healthy after {timeout:.0f}s; log: {self.log_tail()}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout` -> the exit code."""
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log_tail(self, num_chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-num_chars:]


@contextlib.contextmanager
def running_server(args: list[str], *, timeout: float, log_path: str | Path | None = None,
                   env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A `qnext serve ARGS` subprocess on loopback, healthy within `timeout` seconds; stopped however the block
    ends."""
    proc = ServerProcess(args, log_path=log_path, env=env)
    try:
        proc.wait_healthy(timeout)
        yield proc
    finally:
        proc.stop(timeout=30)


def free_port_pair(host: str = "127.0.0.1", attempts: int = 50) -> int:
    """A port P with P + 1 free as well (`--dist-init-addr HOST:P`: rank 0 also listens on P + 1)."""
    for _ in range(attempts):
        port = free_port(host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError(f"found no two free consecutive ports on {host}")


@contextlib.contextmanager
def running_ranks(args: list[str], nnodes: int, *, timeout: float, log_dir: str | Path,
                  env: dict[str, str] | None = None, wait: bool = True) -> Iterator[list[ServerProcess]]:
    """`qnext serve ARGS --nnodes N --node-rank R --dist-init-addr 127.0.0.1:P` for every rank on loopback; rank 0
    healthy within `timeout` (unless not `wait`). Every rank is stopped however the block ends (rank 0 first: its
    SIGTERM stops the others; any left after that are killed)."""
    address = f"127.0.0.1:{free_port_pair()}"
    procs: list[ServerProcess] = []
    try:
        for rank in range(nnodes):
            procs.append(ServerProcess([*args, "--nnodes", str(nnodes), "--node-rank", str(rank), "--dist-init-addr",
                                        address], log_path=Path(log_dir) / f"rank{rank}.log", env=env))
        if wait:
            procs[0].wait_healthy(timeout)
        yield procs
    finally:
        for proc in procs:
            proc.stop(timeout=30)
