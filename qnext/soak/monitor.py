"""Resource samples of the server processes (Linux /proc): RSS, open file descriptors and threads, summed over a
process and its descendants (data-parallel replicas, a prefill server's children), taken every few seconds."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    t: float                 # seconds since the monitor started
    rss_bytes: int
    fds: int
    threads: int
    pids: tuple[int, ...]


def _status_fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return kids


def process_tree(pid: int) -> list[int]:
    """pid and its descendants that are alive now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            todo += _children(p)
            out.append(p)
        except OSError:           # exited meanwhile
            pass
    return out


def sample(roots: list[int], t: float) -> Sample | None:
    rss = fds = threads = 0
    pids = []
    for root in roots:
        for pid in process_tree(root):
            try:
                status = _status_fields(pid)
                rss += int(status["VmRSS"].split()[0]) * 1024
                threads += int(status["Threads"])
                fds += len(os.listdir(f"/proc/{pid}/fd"))
                pids.append(pid)
            except (OSError, KeyError, ValueError):
                pass
    return Sample(t, rss, fds, threads, tuple(sorted(pids))) if pids else None


class ProcessMonitor:
    """Samples `roots()` (a callable: the shape's server processes now, which change across restarts) every
    `interval_s` in a thread of its own until stopped."""

    def __init__(self, roots, interval_s: float = 2.0):
        self.roots, self.interval_s = roots, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self.t_start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)

    def start(self) -> "ProcessMonitor":
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join(10)
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            s = sample(self.roots(), time.monotonic() - self.t_start)
            if s is not None:
                self.samples.append(s)
            self._stop.wait(self.interval_s)
