"""Generate text with qnext.

    python scripts/generate.py                         # demo: a two-turn chat on the built-in tiny checkpoint
    python scripts/generate.py --model DIR --prompt "Hello"
    python scripts/generate.py --model DIR --chat      # interactive multi-turn chat (empty line or Ctrl-D ends)
    python scripts/generate.py --image photo.png --prompt "What is in this picture?"   # the demo reads pictures too
    # two processes, one engine over both processes' devices (run once per rank; rank 0 prints):
    python scripts/generate.py --model DIR --prompt "Hi" --tensor-parallel-size 4 --nnodes 2 --node-rank R \
        --dist-init-addr 127.0.0.1:29500

With no --model the tiny demo checkpoint is built (random weights: the text is gibberish; the point is the engine:
streaming, chunked prefill, and the second chat turn reusing the first turn's cached prefix).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qnext.distributed.multiprocess import add_distributed_flags, distributed_config, initialize  # noqa: E402

DEMO_TURNS = [
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "Now tell the same story from the point of view of the bottle.",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the tiny demo checkpoint)")
    p.add_argument("--prompt", help="generate once for this prompt (chat template applied unless --raw)")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat")
    p.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    p.add_argument("--system", help="system message for chat")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="a picture for the (first) user turn, before its text (repeatable; a vision-language "
                        "checkpoint such as the demo)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None, help="default: min(model limit, 4096)")
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps per jitted call (more: fewer host round trips, burstier streaming)")
    p.add_argument("--no-warm-up", action="store_true", help="compile step shapes lazily instead of up front")
    p.add_argument("--compilation-cache-dir", help="JAX's persistent compilation cache ('none': off; default "
                                                   "$QNEXT_COMPILATION_CACHE_DIR, else ~/.cache/qnext/jax). A run "
                                                   "whose step shapes an earlier run cached skips the warm-up")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices the model's heads are split over (on CPU: that many XLA host devices)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="split the MoE experts over the tensor-parallel devices instead of their units")
    add_distributed_flags(p)
    args = p.parse_args(argv)
    if args.image and args.raw:
        p.error("--image goes into a chat turn; drop --raw")
    if args.nnodes > 1 and args.chat:
        p.error("--chat reads the terminal in one process; with --nnodes > 1 use --prompt (every process runs it)")
    return args


def build_llm(args):
    from tqdm import tqdm

    from qnext.model.host_devices import request_host_devices

    dist = distributed_config(args)
    request_host_devices(args.tensor_parallel_size // dist.nnodes)     # before JAX starts
    initialize(dist)                   # every process runs the same calls; only rank 0 prints
    if dist.node_rank:
        sys.stdout = open(os.devnull, "w")
    import qnext
    from qnext.engine.compilation_cache import warm_up_unless_cached
    from qnext.testing.tiny_checkpoint import demo_checkpoint_dir

    model = args.model
    if model is None:
        print("No --model given: using the built-in tiny demo checkpoint (RANDOM WEIGHTS, the text is gibberish).")
        model = demo_checkpoint_dir()
    with tqdm(total=1, desc="loading weights", unit="step", leave=False) as bar:
        llm = qnext.LLM(model, dtype=args.dtype, max_num_seqs=1, max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                        num_scheduler_steps=args.num_scheduler_steps,
                        tensor_parallel_size=args.tensor_parallel_size,
                        enable_expert_parallel=args.enable_expert_parallel,
                        compilation_cache_dir=args.compilation_cache_dir)
        bar.update()
    if not args.no_warm_up:
        engine = llm.engine

        def warm_up():
            with tqdm(total=engine.num_step_shapes, desc="compiling step shapes", unit="shape", leave=False) as bar:
                engine.warm_up(on_bucket=bar.update)

        # several processes warm up together, whatever each one's cache holds (their steps are collective)
        cache_dir = engine.compilation_cache_dir if dist.nnodes == 1 else None
        warm_up_unless_cached(engine, cache_dir, warm_up, log=lambda msg: None)
    return llm, model


def sampling_params(args):
    from qnext import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, stop=args.stop,
                          seed=args.seed)


class Stats:
    def __init__(self):
        self.tokens = self.seconds = self.ttft = 0.0
        self.turns = 0

    def line(self, llm) -> str:
        cache = llm.engine.cache_stats
        return (f"[stats] {self.tokens / max(self.seconds, 1e-9):.1f} tokens/s, "
                f"TTFT {1000 * self.ttft / max(self.turns, 1):.0f} ms (mean of {self.turns}), "
                f"prompt tokens {cache.prompt_tokens}, reused from cache {cache.reused_tokens}, "
                f"lost to missing state {cache.lost_to_missing_state_tokens}, "
                f"snapshots captured {cache.snapshots_captured}")


def stream_one(llm, prompt, params, stats: Stats) -> str:
    start = time.perf_counter()
    first = None
    text = []
    final = None
    for delta, out in llm.stream(prompt, params):
        if first is None:
            first = time.perf_counter() - start
        print(delta, end="", flush=True)
        text.append(delta)
        final = out
    print()
    elapsed = time.perf_counter() - start
    n = len(final.outputs[0].token_ids)
    stats.tokens += n
    stats.seconds += elapsed
    stats.ttft += first or elapsed
    stats.turns += 1
    print(f"  ({n} tokens, {n / elapsed:.1f} tokens/s, TTFT {1000 * (first or elapsed):.0f} ms, "
          f"{final.num_cached_tokens} prompt tokens reused from cache, finish: {final.outputs[0].finish_reason})")
    return "".join(text)


def chat(llm, args, turns, stats: Stats, pictures: list[dict]) -> None:
    """pictures: content parts for the first user turn (image_parts)."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    params = sampling_params(args)
    for user in turns:
        messages.append({"role": "user", "content": pictures + [{"type": "text", "text": user}] if pictures else user})
        pictures = []
        if turns is DEMO_TURNS:
            print(f"\nuser> {user}")
        print("assistant> ", end="", flush=True)
        reply = stream_one(llm, llm.chat_prompt(messages), params, stats)
        messages.append({"role": "assistant", "content": reply})


def image_parts(paths: list[str]) -> list[dict]:
    """Content parts of the pictures at `paths` (decoded here: a path that is not a picture fails now, by name)."""
    from PIL import Image

    parts = []
    for path in paths:
        try:
            image = Image.open(path)
            image.load()
        except OSError as e:
            raise SystemExit(f"--image {path}: {e}") from None
        parts.append({"type": "image", "image": image})
    return parts


def interactive_turns():
    while True:
        try:
            line = input("\nuser> ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


def main(argv=None) -> int:
    args = parse_args(argv)
    pictures = image_parts(args.image)             # before loading: a bad path fails at once
    llm, model = build_llm(args)
    print(f"model: {model} ({llm.engine.model_config.model_type}, {llm.engine.config.dtype})")
    stats = Stats()
    if args.prompt is not None and args.raw:
        stream_one(llm, args.prompt, sampling_params(args), stats)
    elif args.prompt is not None:
        chat(llm, args, [args.prompt], stats, pictures)
    elif args.chat:
        chat(llm, args, interactive_turns(), stats, pictures)
    else:
        chat(llm, args, DEMO_TURNS, stats, pictures)
    print(stats.line(llm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
