"""The server shapes the soak runs, each started on 127.0.0.1 with the demo checkpoint, and the faults each can
take: a fault is a function of the shape that returns the checks it failed (a list of what went wrong).

single   one `qnext serve` with a persisted prefix cache: SIGTERM drains under load, kill -9 during the cache's save,
         a corrupted cache file, a full disk under the cache's directory (a small tmpfs, where mount is allowed)
dp       `--data-parallel-size 2` (replica processes): a replica stopped (SIGSTOP, a slow peer), a replica killed
pd       a prefill server, a decode server and `qnext pd-router`: the prefill server stopped, killed, restarted
ranks    two ranks of one engine (`--nnodes 2`): rank 1 killed near the end (the engine then answers 503s)
Restarts happen in the first half of a run only: the second half measures resource growth on steady processes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qnext.server.cli import DEMO_MODEL_NAME
from qnext.server.launch import ServerProcess, free_port
from qnext.testing.tiny_checkpoint import demo_checkpoint_dir

SERVER_ARGS = ["--served-model-name", DEMO_MODEL_NAME, "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
               "--max-model-len", "2048", "--block-size", "16", "--log-level", "info", "--shutdown-timeout", "120"]
START_TIMEOUT_S = 900.0          # the first start compiles (later ones read the compilation cache)
CACHE_FILE = "prefix_cache.qnext"


@dataclass
class Fault:
    at: float                    # when, as a fraction of the run (< 0.5: restarts stay in the first half)
    name: str
    inject: Callable[["Shape"], list[str]]
    shape_wide: bool = False     # the whole shape stops answering for a while (a restart)
    drains: bool = False         # SIGTERM: requests in flight must still be answered
    terminal: bool = False       # the shape serves only designed 503s from then on (the window runs to the end)


@dataclass
class Shape:
    name: str
    work_dir: Path
    servers: dict[str, ServerProcess] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    kinds_filter: Callable[[str], bool] = lambda kind: True
    max_model_len: int = 2048

    @property
    def base_url(self) -> str:
        return self.servers["front"].base_url

    @property
    def model(self) -> str:
        return DEMO_MODEL_NAME

    def roots(self) -> dict[str, int]:
        """The live server processes by name (front, prefill, decode, rank1, ...)."""
        return {name: s.proc.pid for name, s in self.servers.items() if s.proc.poll() is None}

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> dict[str, int]:
        """SIGTERM to every process (the front first) -> exit codes."""
        return {name: s.stop(timeout=60) for name, s in self.servers.items()}

    def metrics_text(self) -> str:
        urls = [s.base_url for name, s in self.servers.items() if name != "router"]
        return "\n".join(_get(u + "/metrics") for u in urls)

    def health(self) -> dict:
        return json.loads(_get(self.base_url + "/health"))


class _AppendingServer(ServerProcess):
    """A ServerProcess whose log is appended to across restarts (one file per server of the shape)."""

    def __init__(self, args, *, port, log_path):
        self.port, self.base_url, self.log_path = port, f"http://127.0.0.1:{port}", Path(log_path)
        self.args = args
        with open(self.log_path, "ab") as log:
            cmd = [sys.executable, "-m", "qnext.server", *args, "--host", "127.0.0.1", "--port", str(port)]
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "JAX_PLATFORMS": "cpu"})

    def restart(self) -> "_AppendingServer":
        return _AppendingServer(self.args, port=self.port, log_path=self.log_path)


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


# ---- single -------------------------------------------------------------------------------------------------------
class SingleServer(Shape):
    def __init__(self, work_dir: Path):
        super().__init__("single", work_dir)
        self.cache_dir = work_dir / "prefix-cache"
        self.faults = [Fault(0.05, "SIGTERM drain under load", drain_and_restart, shape_wide=True, drains=True),
                       Fault(0.12, "kill -9 during the cache's save", kill_during_save, shape_wide=True),
                       Fault(0.19, "corrupted cache file", corrupt_cache_file, shape_wide=True),
                       Fault(0.26, "full disk under the cache", full_disk, shape_wide=True)]

    def args(self, cache_dir: Path | None = None) -> list[str]:
        return [str(demo_checkpoint_dir()), *SERVER_ARGS, "--prefix-cache-dir", str(cache_dir or self.cache_dir),
                "--kv-offloading-size", "0.01"]

    def start(self) -> None:
        self._launch(self.args(), free_port())

    def _launch(self, args: list[str], port: int) -> None:
        self.servers["front"] = _AppendingServer(args, port=port, log_path=self.work_dir / "front.log")
        self.servers["front"].wait_healthy(START_TIMEOUT_S)

    def log_since_last_start(self) -> str:
        return self.servers["front"].log_path.read_text(errors="replace").rsplit("=== start", 1)[-1]


def _stop_front(shape: SingleServer, sig=signal.SIGTERM, kill_when: Callable[[], bool] | None = None) -> int:
    server = shape.servers["front"]
    with open(server.log_path, "ab") as f:
        f.write(f"\n=== start {time.strftime('%H:%M:%S')} (after {sig.name})\n".encode())
    server.proc.send_signal(sig)
    if kill_when is not None:
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and not kill_when() and time.monotonic() < deadline:
            time.sleep(0.005)
        if server.proc.poll() is None:
            server.proc.kill()
    try:
        return server.proc.wait(90)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()


def drain_and_restart(shape: SingleServer) -> list[str]:
    code = _stop_front(shape)
    problems = [] if code == 0 else [f"drain: the server exited {code} after SIGTERM (expected 0)"]
    shape._launch(shape.args(), shape.servers["front"].port)
    return problems + _cache_load_problems(shape, allow_refused=False)


def kill_during_save(shape: SingleServer) -> list[str]:
    before = set(os.listdir(shape.cache_dir)) if shape.cache_dir.exists() else set()
    saving = lambda: shape.cache_dir.exists() and bool(set(os.listdir(shape.cache_dir)) - before - {CACHE_FILE})
    _stop_front(shape, kill_when=saving)
    shape._launch(shape.args(), shape.servers["front"].port)
    return _cache_load_problems(shape, allow_refused=True) + _leftovers(shape.cache_dir)


def corrupt_cache_file(shape: SingleServer) -> list[str]:
    _stop_front(shape)
    path = shape.cache_dir / CACHE_FILE
    if not path.exists():
        return ["corrupted cache file: no cache file was written at SIGTERM"]
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    shape._launch(shape.args(), shape.servers["front"].port)
    log = shape.log_since_last_start()
    return [] if "is ignored" in log else ["corrupted cache file: the restarted server did not refuse it"]


def full_disk(shape: SingleServer) -> list[str]:
    """The cache's directory becomes a tmpfs with room for the last file and little more; the server runs a while
    (its cache grows), then its save at SIGTERM runs out of space: it must exit cleanly, leave no partial file, and
    the next start must load the old file whole. Not injected where tmpfs cannot be mounted (said in the report)."""
    _stop_front(shape)
    path = shape.cache_dir / CACHE_FILE
    old = path.read_bytes() if path.exists() else b""
    size = len(old) + 16384
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(shape.cache_dir)],
                      capture_output=True).returncode != 0:
        shape._launch(shape.args(), shape.servers["front"].port)
        return ["(not injected: tmpfs could not be mounted here)"]
    try:
        path.write_bytes(old)
        shape._launch(shape.args(), shape.servers["front"].port)
        time.sleep(20)                           # the load fills the cache beyond the room left
        code = _stop_front(shape)
        log = shape.log_since_last_start()
        problems = [] if code == 0 else [f"the server exited {code} when the save ran out of space"]
        problems += _leftovers(shape.cache_dir)
        if path.exists() and path.read_bytes() != old and "written to" not in log:
            problems.append("the old cache file changed although no save succeeded")
        saved = path.read_bytes() if path.exists() else b""
    finally:
        subprocess.run(["umount", str(shape.cache_dir)], capture_output=True)
    path.write_bytes(saved)
    shape._launch(shape.args(), shape.servers["front"].port)
    return problems + _cache_load_problems(shape, allow_refused=False)


def _cache_load_problems(shape: SingleServer, allow_refused: bool) -> list[str]:
    log = shape.log_since_last_start()
    if "Traceback" in log:
        return ["restart: the log has a traceback:\n" + log[log.index("Traceback"):][:1500]]
    if "loaded from" in log or (allow_refused and "is ignored" in log):
        return []
    return ["restart: the persisted cache was neither loaded nor refused"]


def _leftovers(directory: Path) -> list[str]:
    extra = [n for n in os.listdir(directory) if n != CACHE_FILE and not n.endswith(".json")]
    return [f"{directory}: files left behind by an interrupted save: {extra}"] if extra else []


# ---- data parallel ------------------------------------------------------------------------------------------------
class DataParallel(Shape):
    def __init__(self, work_dir: Path):
        super().__init__("dp", work_dir)
        self.faults = [Fault(0.15, "a replica stopped for 8 s (SIGSTOP)", stop_replica),
                       Fault(0.30, "kill -9 of a replica", kill_replica)]

    def start(self) -> None:
        args = [str(demo_checkpoint_dir()), *SERVER_ARGS, "--data-parallel-size", "2"]
        self.servers["front"] = _AppendingServer(args, port=free_port(), log_path=self.work_dir / "front.log")
        self.servers["front"].wait_healthy(START_TIMEOUT_S)

    def replica_pid(self, index: int) -> int:
        return self.health()["replicas"][index]["pid"]


def stop_replica(shape: DataParallel) -> list[str]:
    pid = shape.replica_pid(1)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(8)
    os.kill(pid, signal.SIGCONT)
    return []


def kill_replica(shape: DataParallel) -> list[str]:
    os.kill(shape.replica_pid(1), signal.SIGKILL)
    time.sleep(3)
    up = shape.health().get("replicas_up")
    return [] if up == 1 else [f"after kill -9 of a replica /health says {up} replicas up (expected 1)"]


# ---- prefill / decode ---------------------------------------------------------------------------------------------
class PrefillDecode(Shape):
    def __init__(self, work_dir: Path):
        super().__init__("pd", work_dir, kinds_filter=lambda kind: kind in _pd_kinds())
        self.faults = [Fault(0.15, "the prefill server stopped for 8 s (SIGSTOP)", stop_prefill),
                       Fault(0.30, "kill -9 of the prefill server, then a restart", kill_prefill)]

    def start(self) -> None:
        model = str(demo_checkpoint_dir())
        prefill = _AppendingServer([model, *SERVER_ARGS, "--pd-role", "prefill"], port=free_port(),
                                   log_path=self.work_dir / "prefill.log")
        decode = _AppendingServer([model, *SERVER_ARGS, "--pd-role", "decode", "--pd-prefill-url", prefill.base_url],
                                  port=free_port(), log_path=self.work_dir / "decode.log")
        self.servers.update(prefill=prefill, decode=decode)
        prefill.wait_healthy(START_TIMEOUT_S)
        decode.wait_healthy(START_TIMEOUT_S)
        router = _AppendingServer(["pd-router", "--prefill", prefill.base_url, "--decode", decode.base_url],
                                  port=free_port(), log_path=self.work_dir / "router.log")
        self.servers["front"] = router
        router.wait_healthy(120)

    def metrics_text(self) -> str:
        return "\n".join(_get(self.servers[k].base_url + "/metrics") for k in ("prefill", "decode"))


def _pd_kinds() -> set[str]:
    from qnext.soak.requests import ROUTED_BY_PD

    return ROUTED_BY_PD


def stop_prefill(shape: PrefillDecode) -> list[str]:
    pid = shape.servers["prefill"].proc.pid
    os.kill(pid, signal.SIGSTOP)
    time.sleep(8)
    os.kill(pid, signal.SIGCONT)
    return []


def kill_prefill(shape: PrefillDecode) -> list[str]:
    prefill = shape.servers["prefill"]
    prefill.proc.kill()
    prefill.proc.wait()
    time.sleep(5)                       # requests meanwhile get the router's 503
    shape.servers["prefill"] = prefill.restart()
    shape.servers["prefill"].wait_healthy(START_TIMEOUT_S)
    return []


# ---- ranks ---------------------------------------------------------------------------------------------------------
class MultiRank(Shape):
    """Two ranks of one engine (`--nnodes 2` on the loopback). Losing a rank stops the engine for good (every rank
    must restart), so its kill comes last: from then on every request is the designed 503 that names the rank, and
    the resource window ends where the kill begins."""

    def __init__(self, work_dir: Path):
        super().__init__("ranks", work_dir)
        self.faults = [Fault(0.9, "kill -9 of rank 1", kill_rank, terminal=True)]

    def start(self) -> None:
        from qnext.server.launch import free_port_pair

        address = f"127.0.0.1:{free_port_pair()}"
        for rank in (1, 0):
            args = [str(demo_checkpoint_dir()), *SERVER_ARGS, "--nnodes", "2", "--node-rank", str(rank),
                    "--dist-init-addr", address]
            self.servers[f"rank{rank}"] = _AppendingServer(args, port=free_port(),
                                                           log_path=self.work_dir / f"rank{rank}.log")
        self.servers["front"] = self.servers.pop("rank0")
        self.servers["front"].wait_healthy(START_TIMEOUT_S)

    def metrics_text(self) -> str:
        return _get(self.base_url + "/metrics")


def kill_rank(shape: MultiRank) -> list[str]:
    shape.servers["rank1"].proc.kill()
    shape.servers["rank1"].proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            _get(shape.base_url + "/health")
        except urllib.error.HTTPError as e:
            if e.code == 503:
                return []
        time.sleep(1)
    return ["rank 0's /health did not turn 503 within 60 s of rank 1's kill -9"]


SHAPES = {"single": SingleServer, "dp": DataParallel, "pd": PrefillDecode, "ranks": MultiRank}
