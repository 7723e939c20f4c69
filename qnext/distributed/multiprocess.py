"""Several processes, one engine (SGLang's --nnodes / --node-rank / --dist-init-addr).

Every process runs the same engine: `jax.distributed.initialize` joins them, the tensor-parallel mesh spans all
processes' devices (jax.devices() lists them, process by process), and each process loads only its devices' shards.
JAX is multi-controller: each process must dispatch the same jitted step, with the same shapes, in the same order.

The choice: every process schedules identically from the same requests, instead of one process scheduling and
broadcasting its plan. The scheduler is deterministic (plain Python over the same requests in the same order), the
step's outputs (tokens, logprobs) are replicated on every device, so every process reads the same tokens back and
its scheduler takes the same next decision; only the requests themselves must reach every process. A plan holds
the block tables, rows and per-sequence state that the cache manager derives anyway, and broadcasting it would
need a second, follower-only path through the runner; broadcasting requests keeps one path (the LLM engine) and
costs one small broadcast per step in a server (`RequestBroadcast`), nothing offline (every process gets the same
prompts). On CPU the collectives run over gloo (TCP), so this is tested with processes on the loopback.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from qnext.distributed.request_codec import decode_ops, encode_ops


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    nnodes: int = 1                      # processes (SGLang: nodes); each brings its local devices
    node_rank: int = 0                   # this process's rank, 0 .. nnodes - 1; rank 0 takes requests
    dist_init_addr: str | None = None    # host:port of rank 0's coordinator

    def __post_init__(self):
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"nnodes must be a positive integer, got {self.nnodes!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (host:port of rank 0's coordinator)")
        if self.dist_init_addr and not self.dist_init_addr.rpartition(":")[2].isdigit():
            raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")


def initialize(config: DistributedConfig, timeout_s: int = 300, serving: bool = False) -> None:
    """Joins this process to the others (a no-op for one process). Call before anything touches JAX's devices.
    CPU devices use gloo collectives (JAX's default CPU collectives do not cross processes). `serving`: a rank that
    dies makes the others' collectives raise instead of aborting every process (rank 0 keeps answering, 503), and
    SIGTERM stays the server's (JAX's preemption notifier would take it over)."""
    if config.nnodes == 1:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if serving:
        jax.config.update("jax_enable_recoverability", True)
        jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(coordinator_address=config.dist_init_addr, num_processes=config.nnodes,
                               process_id=config.node_rank, initialization_timeout=timeout_s)


class RanksNotReadyError(RuntimeError):
    """Not every rank reached a start-up barrier in time."""


def wait_for_every_rank(name: str, timeout_s: float) -> None:
    """Returns once every process has called this with the same `name` (a barrier of jax.distributed's coordination
    service: no device collective, so a rank still compiling cannot make it mismatch); RanksNotReadyError after
    `timeout_s` naming the barrier. Each name is used once. A no-op in one process."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    try:
        client.wait_at_barrier(f"qnext-{name}", int(timeout_s * 1000))
    except Exception as e:          # jaxlib's JaxRuntimeError: DEADLINE_EXCEEDED, or a rank that failed
        raise RanksNotReadyError(f"not every rank was {name} within {timeout_s:g} s: {str(e).splitlines()[0]}") \
            from None


def is_leader() -> bool:
    import jax

    return jax.process_index() == 0


class RequestBroadcast:
    """What rank 0 received since the last step (new requests, aborts, as request_codec.py encodes them: plain data,
    never pickle), sent to every process before each step so that their schedulers see the same requests in the same
    order. Two broadcasts a step: the length, then the bytes (jax.experimental.multihost_utils.broadcast_one_to_all)."""

    def exchange(self, ops: list | None) -> list:
        """Rank 0 passes its ops and every other process None; all get rank 0's ops back."""
        from jax.experimental import multihost_utils

        import jax

        if jax.process_count() == 1:
            return ops or []
        data = np.frombuffer(encode_ops(ops or []), np.uint8) if is_leader() else np.zeros(0, np.uint8)
        size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
        buf = np.zeros(size, np.uint8)
        if is_leader():
            buf[:] = data
        buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
        return decode_ops(buf.tobytes())


class LockstepEngine:
    """An LLMEngine driven alike in every process: rank 0's add_request / abort_request calls are queued and, before
    each step, sent to every process (RequestBroadcast) and applied there in the same order, so every scheduler plans
    the same step. Rank 0 drives it as it would drive the engine; every other process calls `follow()`, which steps
    until rank 0 calls `shutdown()`."""

    def __init__(self, engine):
        self.engine = engine
        self._ops: list = []
        self._broadcast = RequestBroadcast()

    def add_request(self, request_id: str, prompt, params=None) -> None:
        self._ops.append(("add", request_id, prompt, params))

    def abort_request(self, request_id: str) -> None:
        self._ops.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._ops) or self.engine.has_unfinished_requests()

    def step(self) -> list:
        """Applies rank 0's queued requests in every process, then runs one engine step (the same everywhere)."""
        ops = self._broadcast.exchange(self._ops if is_leader() else None)
        self._ops = []
        for op in ops:
            if op[0] == "shutdown":
                return None
            if op[0] == "add":
                self.engine.add_request(*op[1:])
            else:
                self.engine.abort_request(op[1])
        return self.engine.step()

    def shutdown(self) -> None:
        """Rank 0: ends every other process's `follow()`."""
        self._broadcast.exchange([("shutdown",)])

    def follow(self) -> int:
        """Every process but rank 0: steps as rank 0 does until it shuts down. Returns the steps run."""
        steps = 0
        while self.step() is not None:
            steps += 1
        return steps


def add_distributed_flags(parser) -> None:
    """SGLang's flags for a run over several processes (an argparse parser)."""
    parser.add_argument("--nnodes", type=int, default=1, help="processes (nodes) that run the engine together")
    parser.add_argument("--node-rank", type=int, default=0, help="this process's rank (0: takes the requests)")
    parser.add_argument("--dist-init-addr", help="host:port of rank 0's coordinator (with --nnodes > 1)")


def distributed_config(args) -> DistributedConfig:
    return DistributedConfig(nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr)
