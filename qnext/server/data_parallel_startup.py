"""`qnext serve --data-parallel-size N`: the N replicas started, threads of this process or processes of their own
(data_parallel.py says how they serve)."""
from __future__ import annotations

import logging

from qnext.server.data_parallel import DataParallelEngine
from qnext.server.merged_metrics import MergedMetrics

logger = logging.getLogger("qnext.server")


def build_replicas(model, engine_options: dict, args, model_name: str) -> tuple[DataParallelEngine, MergedMetrics]:
    """The replicas, loaded and warmed up -> the DataParallelEngine and its metrics, for build_app. Threads: replica
    i on the devices from i * tensor_parallel_size (jax.default_device while it loads:
    qnext.model.host_devices.engine_devices)."""
    if getattr(args, "data_parallel_backend", "thread") == "process":
        return _build_process_replicas(model, engine_options, args, model_name)
    import jax

    import qnext
    tp = engine_options.get("tensor_parallel_size") or 1
    devices = jax.devices()
    if len(devices) < args.data_parallel_size * tp:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} x tensor_parallel_size {tp} needs "
                         f"{args.data_parallel_size * tp} devices; JAX sees {len(devices)}")
    engines = []
    for i in range(args.data_parallel_size):
        with jax.default_device(devices[i * tp]):
            logger.info("replica %d on devices %d..%d", i, i * tp, (i + 1) * tp - 1)
            engines.append(qnext.LLM(model, warm_up=not args.no_warm_up, progress=logger.info,
                                     **engine_options).engine)
    dp = DataParallelEngine.of_threads(engines, max_waiting_requests=args.max_waiting_requests, model_name=model_name,
                                       routing=args.data_parallel_routing,
                                       devices=[devices[i * tp] for i in range(args.data_parallel_size)])
    return dp, dp.server_metrics


def _build_process_replicas(model, engine_options: dict, args, model_name: str):
    """A process per replica (replica_worker.py), each on its own devices (replica_devices.py: it refuses to start
    on others); the tokenizer is loaded here for the HTTP side."""
    from pathlib import Path

    from qnext.engine.visual_intake import vision_setup
    from qnext.server.replica_devices import assign_replica_devices
    from qnext.server.replica_process import ProcessReplica, served_model_of
    from qnext.tokenizer import Tokenizer

    assignments = assign_replica_devices(args.data_parallel_size, engine_options.get("tensor_parallel_size") or 1)
    replicas = [ProcessReplica(devices, model, engine_options, max_waiting_requests=args.max_waiting_requests,
                               warm_up=not args.no_warm_up, log_level=args.log_level) for devices in assignments]
    try:
        infos = [r.wait_ready(timeout=3600) for r in replicas]
    except BaseException:
        for r in replicas:
            r.stop(timeout=5)
        raise
    for r, info in zip(replicas, infos):
        logger.info("replica %d ready (pid %d)", r.index, info["pid"])
    tokenizer = Tokenizer.from_pretrained(model) if (Path(model) / "tokenizer.json").is_file() else None
    vision = vision_setup(model, None, preprocess_only=True) if infos[0]["vision"] else None
    for r, info in zip(replicas, infos):
        r.set_served_model(served_model_of(info, tokenizer, vision))
    dp = DataParallelEngine(replicas, model_name=model_name, routing=args.data_parallel_routing)
    return dp, dp.server_metrics
