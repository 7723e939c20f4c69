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
    rss_by_process: dict | None = None   # server name (with its descendants) -> RSS bytes


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


def sample(roots, t: float) -> Sample | None:
    """roots: pids, or {name: pid} (then the sample also has each name's RSS, its descendants included)."""
    named = roots if isinstance(roots, dict) else {str(pid): pid for pid in roots}
    rss = fds = threads = 0
    pids, by_name = [], {}
    for name, root in named.items():
        for pid in process_tree(root):
            try:
                status = _status_fields(pid)
                kib = int(status["VmRSS"].split()[0]) * 1024
                threads += int(status["Threads"])
                fds += len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, KeyError, ValueError):
                continue
            rss += kib
            by_name[name] = by_name.get(name, 0) + kib
            pids.append(pid)
    return Sample(t, rss, fds, threads, tuple(sorted(pids)), by_name) if pids else None


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
