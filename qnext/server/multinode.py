"""`qnext serve --nnodes N --node-rank R --dist-init-addr HOST:PORT`: one engine over N processes.

Every rank loads the same model, tensor parallel over all ranks' devices (tensor_parallel_size defaults to that
count), and warms up the same step shapes in the same order; the ranks start serving together, once every one has
warmed up (a barrier, --dist-start-timeout), whatever each one's compilation cache held. Rank 0 serves HTTP
(RankGate in front of the usual app) and drives the engine through ServedLockstepEngine; the other ranks follow its
broadcasts until it shuts down. Each follower first passes a handshake on rank 0's PORT + 1 (rank_handshake.py: the
cluster secret, its rank, the checkpoint's identity, the engine options; a stranger or a rank with another
checkpoint is refused and changes nothing) and then heartbeats there (rank_heartbeat.py), so a rank that exits or
hangs turns into 503s with the reason within --dist-timeout seconds (at once when it exits: the collectives fail),
and a rank that never joins does the same once --dist-timeout has passed. SIGTERM on rank 0 drains, then stops
every rank. Ranks beyond the loopback need --cluster-secret-file (docs/security.md, "Multi-host ranks")."""
from __future__ import annotations

import argparse
import logging
import threading

from qnext.distributed.cluster_secret import ClusterSecret, load_cluster_secret, require_secret_beyond_loopback
from qnext.distributed.multiprocess import (RanksNotReadyError, add_distributed_flags, distributed_config, initialize,
                                            wait_for_every_rank)
from qnext.distributed.rank_handshake import HandshakeRefused, RankCredentials
from qnext.distributed.rank_heartbeat import HeartbeatSender, RankMonitor, heartbeat_address
from qnext.distributed.served_lockstep import RanksDivergedError, RanksDownError, ServedLockstepEngine

logger = logging.getLogger("qnext.server")

KEEPALIVE_S = 0.5        # rank 0 exchanges with the followers at least this often while idle


def add_multinode_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (SGLang's names; rank 0 also listens on the coordinator's PORT + 1 "
                             "for the other ranks' heartbeats)")
    add_distributed_flags(g)
    g.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds for every rank to join, and the longest a rank may be silent before rank 0 "
                        "answers 503")
    g.add_argument("--dist-start-timeout", type=float, default=3600.0,
                   help="seconds every rank may take to load and warm up; the ranks start serving together once "
                        "all have, and give up (naming the barrier) after this")


def rank_secret(args) -> ClusterSecret | None:
    """The cluster secret the ranks' handshake uses; ValueError when it cannot be read, or when --dist-init-addr is
    beyond the loopback and there is none."""
    secret = load_cluster_secret(args.cluster_secret_file)
    require_secret_beyond_loopback(secret, [args.dist_init_addr.rpartition(":")[0]], "--dist-init-addr")
    return secret


def build_lockstep_engine(model, engine_options: dict, args, monitor=None) -> ServedLockstepEngine:
    """Joins the ranks, loads the model over every rank's devices and warms it up (the same on every rank)."""
    import jax

    import qnext
    from qnext.server.startup import warm_up_with_progress

    initialize(distributed_config(args), timeout_s=max(1, int(args.dist_timeout)), serving=True)
    options = dict(engine_options)
    options.setdefault("tensor_parallel_size", jax.device_count())
    logger.info("rank %d of %d joined; %d devices in all; loading %s", args.node_rank, args.nnodes,
                jax.device_count(), model)
    engine = qnext.LLM(model, progress=logger.info, **options).engine
    # the warm-up runs steps, whose collectives would wait on a rank still loading: start it together
    wait_for_every_rank("loaded", args.dist_start_timeout)
    if not args.no_warm_up:
        warm_up_with_progress(engine)
    logger.info("rank %d is ready; waiting for every rank to be", args.node_rank)
    wait_for_every_rank("warmed up", args.dist_start_timeout)
    return ServedLockstepEngine(engine, monitor, keepalive_s=KEEPALIVE_S)


def follow(model, engine_options: dict, args, secret: ClusterSecret | None) -> int:
    """A rank > 0: handshake and heartbeat to rank 0, join, load, then step as rank 0 says until it shuts down.
    Exit status 2 when rank 0 refuses this rank (its reason logged), 1 when the engine fails."""
    try:
        credentials = RankCredentials.of(model, engine_options, secret)
        sender = HeartbeatSender(heartbeat_address(args.dist_init_addr), args.node_rank, credentials,
                                 connect_timeout_s=args.dist_timeout)
    except (HandshakeRefused, TimeoutError, OSError) as e:
        logger.error("rank %d cannot join: %s", args.node_rank, e)
        return 2
    try:
        engine = build_lockstep_engine(model, engine_options, args)
        steps = engine.follow()
    except (RanksDownError, RanksDivergedError, RanksNotReadyError) as e:
        logger.error("rank %d stops: %s", args.node_rank, e)
        sender.stop()
        return 1
    import jax

    # leave jax.distributed while rank 0 still waits on the heartbeat connection (its coordination service is up)
    jax.distributed.shutdown()
    sender.stop()
    logger.info("rank %d: rank 0 shut down after %d steps", args.node_rank, steps)
    return 0


def watch_ranks(monitor, async_engine, every_s: float = 0.5) -> None:
    """Rank 0: once a rank is down, the requests in flight fail at once, even when the engine thread is stuck in a
    collective that waits for that rank (a hung rank; an exited one makes the collective raise anyway)."""
    import time

    from qnext.server.engine_errors import EngineStoppedError

    while async_engine.is_running:
        why = monitor.failure()
        if why is not None:
            async_engine.abandon(EngineStoppedError(f"the engine lost a rank: {why}"))
            return
        time.sleep(every_s)


def lead(model, engine_options: dict, args, names: list[str], secret: ClusterSecret | None):
    """Rank 0: the gate (serving 503s at once) and a thread that joins the ranks and opens it -> the ASGI app."""
    from qnext.server.app import build_app, build_async_engine
    from qnext.server.media_flags import media_limits
    from qnext.server.rank_gate import RankGate, RanksCollector

    monitor = RankMonitor(args.nnodes, heartbeat_address(args.dist_init_addr), timeout_s=args.dist_timeout,
                          credentials=RankCredentials.of(model, engine_options, secret))
    gate = RankGate(monitor, args.nnodes, shutdown_timeout=args.shutdown_timeout)

    def start() -> None:
        missing = monitor.wait_for_all(args.dist_timeout)
        if missing or monitor.failure() is not None:
            gate.fail(monitor.failure() or
                      f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {args.nnodes} did "
                      f"not join within {args.dist_timeout:g} s (--dist-timeout): start every rank with the same "
                      f"--nnodes and --dist-init-addr {args.dist_init_addr}, then restart rank 0"
                      + (f" (last refusal: {monitor.last_refusal})" if monitor.last_refusal else ""))
            return
        try:
            engine = build_lockstep_engine(model, engine_options, args, monitor)
            async_engine, metrics = build_async_engine(engine, max_waiting_requests=args.max_waiting_requests,
                                                       model_name=names[0], idle_wake_s=KEEPALIVE_S,
                                                       fatal_errors=(RanksDownError,))
            metrics.registry.register(RanksCollector(lambda: monitor.ranks_up, args.nnodes))
            app = build_app(engine, model_name=names[0], aliases=names[1:], tool_call_parser=args.tool_call_parser,
                            reasoning_parser=args.reasoning_parser, api_key=args.api_key,
                            max_request_bytes=args.max_request_bytes, async_engine=async_engine, metrics=metrics,
                            media_limits=media_limits(args))
            gate.open(app, async_engine, engine)
            threading.Thread(target=watch_ranks, args=(monitor, async_engine), name="qnext-rank-watch",
                             daemon=True).start()
        except Exception as e:
            logger.exception("the engine did not start")
            gate.fail(f"the engine did not start: {e}")

    threading.Thread(target=start, name="qnext-rank0-start", daemon=True).start()
    return gate
