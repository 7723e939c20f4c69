"""`qnext serve [MODEL]`: the OpenAI-compatible HTTP server (also `python -m qnext.server [MODEL]`).

Every engine option is a flag with vLLM's name (--max-num-seqs, --block-size, --enable-prefix-caching /
--no-enable-prefix-caching, ...), derived from EngineConfig so that new options appear here without edits.
SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish (at most --shutdown-timeout
seconds), then exits 0."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys

from qnext.engine.config import EngineConfig
from qnext.server.flag_values import json_object
from qnext.server.media_flags import add_media_arguments, media_limits

logger = logging.getLogger("qnext.server")

DEMO_MODEL_NAME = "qnext-tiny-demo"


OPTION_HELP = {   # engine options whose default is not a plain value
    "compilation_cache_dir": "JAX's persistent compilation cache ('none': off); default $QNEXT_COMPILATION_CACHE_DIR, "
                             "else ~/.cache/qnext/jax",
}


def engine_option_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Adds a flag per EngineConfig field (default None: the engine's own default) -> the field names."""
    group = parser.add_argument_group("engine options (vLLM names; default: the engine's default)")
    names = []
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = str(field.type)
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = OPTION_HELP.get(field.name, f"engine default: {default}")
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            convert = (json_object if "dict" in kind else int if "int" in kind else float if "float" in kind
                       else str)
            group.add_argument(flag, type=convert, default=None, metavar=field.name.upper(), help=help_text)
        names.append(field.name)
    return names


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(prog="qnext", description="qnext: a JAX/XLA engine for Qwen3.5 / Qwen3-Next")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(serve)
    router = commands.add_parser("pd-router", help="route requests over a prefill and a decode server (PD)")
    add_pd_router_arguments(router)
    return parser, engine_option_flags(serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="Hugging Face checkpoint directory (default: the built-in tiny demo "
                                            "checkpoint, random weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the names clients may pass as `model` (the first is the one reported; default: MODEL as "
                        "given); e.g. the names an agent sends for its main and small models")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait for a batch slot; beyond it the server answers 503")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--no-warm-up", action="store_true", help="compile step shapes on first use instead of at start")
    p.add_argument("--no-warm-up-cache-check", action="store_true",
                   help="warm up at every start, even when the compilation cache holds every step shape from an "
                        "earlier start (by default such a start skips the warm-up and loads each shape on first use)")
    p.add_argument("--tool-call-parser", choices=["qwen3_coder", "hermes", "none"],
                   help="the format the model writes tool calls in (default: read from the chat template: "
                        "qwen3_coder for Qwen3.5's XML calls, hermes for Qwen3-Next's JSON calls)")
    p.add_argument("--reasoning-parser", choices=["qwen3", "none"],
                   help="how the model's thinking is split from its answer (default: qwen3 when the chat template "
                        "opens <think>)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; tool_choice 'auto' is always served")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="with --enable-lora: LoRA adapters served by name (a request's `model` picks one), each "
                        'name=path or JSON {"name": ..., "path": ...} (vLLM\'s); more can be loaded at run time '
                        "with POST /v1/load_lora_adapter when --api-key is set")
    add_access_arguments(p)
    add_media_arguments(p)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas, each on its own tensor_parallel_size devices (qnext/server/data_parallel.py)")
    p.add_argument("--data-parallel-routing", default="cache_aware", choices=["cache_aware", "round_robin"],
                   help="with --data-parallel-size > 1: to the replica holding the longest cached prefix, or in turn")
    p.add_argument("--data-parallel-backend", default="process", choices=["process", "thread"],
                   help="with --data-parallel-size > 1: each replica in a process of its own (its own devices and "
                        "Python), or all as threads of the HTTP process")
    from qnext.distributed.cluster_secret import add_cluster_secret_arguments
    from qnext.server.multinode import add_multinode_arguments
    from qnext.server.pd_options import add_pd_arguments

    add_pd_arguments(p)
    add_multinode_arguments(p)
    add_cluster_secret_arguments(p)     # one secret for every internal link: PD's and the ranks'


def add_pd_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, action="append", metavar="URL",
                   help="a `qnext serve --pd-role prefill` server (repeat for several)")
    p.add_argument("--decode", required=True, action="append", metavar="URL",
                   help="a `qnext serve --pd-role decode` server (repeat for several)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_access_arguments(p: argparse.ArgumentParser) -> None:
    from qnext.server.body_limit import DEFAULT_MAX_REQUEST_BYTES

    p.add_argument("--api-key", default=os.environ.get("QNEXT_API_KEY") or None,
                   help="require this key on /v1 routes (Authorization: Bearer, or x-api-key on /v1/messages); "
                        "default: $QNEXT_API_KEY, else no key")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies are refused with 413 before they are read")


def serve(args: argparse.Namespace, engine_options: dict) -> int:
    from qnext.model.host_devices import request_host_devices

    if args.data_parallel_size < 1:
        logger.error("--data-parallel-size must be a positive integer, got %d", args.data_parallel_size)
        return 2
    if args.nnodes > 1:                 # each rank brings tensor_parallel_size / nnodes devices
        request_host_devices((engine_options.get("tensor_parallel_size") or args.nnodes) // args.nnodes)
    elif args.data_parallel_size == 1 or args.data_parallel_backend == "thread":
        per_replica = max(engine_options.get("tensor_parallel_size") or 1,
                          engine_options.get("context_parallel_size") or 1)     # CP refuses TP: one of them is 1
        request_host_devices(per_replica * args.data_parallel_size)                 # before JAX starts
    import qnext
    from qnext.engine.startup_heap import freeze_startup_heap
    from qnext.server.app import build_app
    from qnext.server.lora_adapters import ServedAdapters, parse_lora_modules
    from qnext.engine.compilation_cache import resolve_compilation_cache_dir, warm_up_unless_cached
    from qnext.server.startup import warm_up_with_progress
    from qnext.testing.tiny_checkpoint import demo_checkpoint_dir

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, names = args.model, args.served_model_name or []
    if model is None:
        logger.warning("no MODEL given: serving the built-in tiny demo checkpoint (random weights, gibberish text)")
        model, names = demo_checkpoint_dir(), names or [DEMO_MODEL_NAME]
    names = names or [str(args.model)]
    if args.nnodes > 1:
        from qnext.distributed.multiprocess import distributed_config
        from qnext.server.multinode import follow, lead, rank_secret

        try:
            distributed_config(args)
            secret = rank_secret(args)
        except ValueError as e:
            logger.error("%s", e)
            return 2
        if args.lora_modules:
            logger.error("--lora-modules is not served by a multi-node (--nnodes > 1) server yet")
            return 2
        if args.data_parallel_size > 1 or args.pd_role:
            logger.error("--nnodes > 1 runs one engine over every rank; --data-parallel-size > 1 or --pd-role with "
                         "it is not supported: start one multi-rank server per replica instead")
            return 2
        if args.node_rank > 0:
            return follow(model, engine_options, args, secret)
        gate = lead(model, engine_options, args, names, secret)
        code = run_uvicorn(gate, args)
        if gate.lost_rank:          # the engine thread may sit in a collective for ever: leave without it
            logger.warning("rank 0 exits without waiting for the engine, which lost a rank")
            logging.shutdown()
            os._exit(code)
        return code
    logger.info("loading %s with %s; compilation cache: %s", model, engine_options or "the engine's default options",
                resolve_compilation_cache_dir(engine_options.get("compilation_cache_dir")) or "off")
    try:
        async_engine = metrics = None
        if args.data_parallel_size > 1 and args.pd_role:
            raise ValueError("--pd-role serves one engine; drop --data-parallel-size")
        from qnext.server.pd_options import pd_options_from_args

        pd = pd_options_from_args(args)                                # before the model loads: minutes
        pictures = media_limits(args)                                  # the same: a bad media flag is a ValueError
        if args.lora_modules and not engine_options.get("enable_lora"):
            raise ValueError("--lora-modules needs --enable-lora")
        lora_modules = parse_lora_modules(args.lora_modules or [])       # before the model loads: minutes
        if args.data_parallel_size > 1:
            from qnext.server.data_parallel_startup import build_replicas

            engine = None                                              # the replicas' engines are theirs
            async_engine, metrics = build_replicas(model, engine_options, args, names[0])
        else:
            engine = qnext.LLM(model, progress=logger.info, **engine_options).engine
            if not args.no_warm_up:
                cache_dir = None if args.no_warm_up_cache_check else engine.compilation_cache_dir
                warm_up_unless_cached(engine, cache_dir, lambda: warm_up_with_progress(engine))
        adapters = None
        if engine_options.get("enable_lora"):
            adapters = ServedAdapters(engine, tuple(names), engine_options.get("max_lora_rank"))
            for name, path in lora_modules:
                adapters.load(name, path)
    except ValueError as e:                     # a bad option or checkpoint: say which, without a traceback
        logger.error("cannot serve %s: %s", model, e)
        return 2
    freeze_startup_heap()              # a long-running front end: the cyclic GC skips the start-up heap
    app = build_app(engine, model_name=names[0], aliases=names[1:], max_waiting_requests=args.max_waiting_requests,
                    tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                    api_key=args.api_key, max_request_bytes=args.max_request_bytes, async_engine=async_engine,
                    metrics=metrics, media_limits=pictures, pd=pd, adapters=adapters)
    return run_uvicorn(app, args)


def run_uvicorn(app, args: argparse.Namespace) -> int:
    """Serves `app` until SIGTERM / Ctrl-C (drained, exit 0); 1 if the server could not start."""
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn drains on SIGTERM / SIGINT, then re-raises the signal to the handler it found: make that one a no-op
    # so a drained shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        logger.error("the server did not start (is port %d on %s free?)", args.port, args.host)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, option_names = build_parser()
    args = parser.parse_args(argv)
    options = {n: getattr(args, n, None) for n in option_names if getattr(args, n, None) is not None}
    if args.command == "serve":
        return serve(args, options)
    if args.command == "pd-router":
        from qnext.server.pd_router import build_pd_router

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_uvicorn(build_pd_router(args.prefill, args.decode), args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
