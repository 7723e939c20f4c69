"""LoRA serving cost (docs/lora.md), three engine set-ups side by side in one run, same checkpoint and prompts:

- base:        enable_lora off;
- lora-idle:   enable_lora on (max_loras adapters' stacks on device, every projection takes the masked all-slot
               delta), no request using an adapter;
- lora-mix:    the same engine, the batch's rows spread over `--adapters` adapters (row i -> adapter i mod A).

Decode tokens/s at batch B: each pass adds B prompts of fresh random tokens (prefix caching off) to run to
max_tokens=N, steps the engine until every row has its first token, then times the decode steps alone:
B (N - 1) / their seconds (the whole batch decodes together until it finishes). The
set-ups alternate pass by pass (--repeats), after an untimed pass of each that compiles its shapes, and each
reports its fastest pass, so a slow spell of a shared machine decides no ratio. Adapter load (after the passes, so
the jitted slot write is compiled): the median of 4 never-seen adapters from disk into a device slot (read + check +
fuse + the slot write, finished on device), and of 3 whose slots they took, back from host memory (max_cpu_loras).

    python scripts/bench_lora.py                                # small preset, B=16, 4 adapters of rank 16
    python scripts/bench_lora.py --preset tiny --max-tokens 8   # a quick check
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def prompts(rng, batch: int, length: int, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": [int(t) for t in rng.integers(3, vocab, length)]} for _ in range(batch)]


def decode_rate(llm, rng, args, vocab, loras) -> float:
    """B prompts added at once; the engine stepped until every row has its first token (prefill), then the decode
    steps timed alone -> B (N - 1) / their seconds."""
    import qnext

    engine = llm.engine
    params = qnext.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"bench-{next(_ids)}" for _ in range(args.batch)]
    for rid, prompt, lora in zip(ids, prompts(rng, args.batch, args.prompt_len, vocab), loras or [None] * args.batch):
        engine.add_request(rid, prompt, params, lora)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - t0
    for rid in ids:
        engine.release(rid)
    return args.batch * (args.max_tokens - 1) / seconds


_ids = itertools.count()


def load_times(llm, cold: list, evicted: list) -> dict:
    """Seconds from a request's LoRARequest to its adapter in a device slot (finished on device), through the
    registry's public calls: `cold` adapters never seen (read from disk), then `evicted` ones (in host memory, their
    slots taken by the cold ones)."""
    import jax

    registry = llm.engine.lora

    def into_slot(request) -> float:
        t0 = time.perf_counter()
        use = registry.use(request)
        assert registry.bind(use), "no idle slot: the bench's requests should all have finished"
        jax.block_until_ready(registry.stacks.stacks)
        seconds = time.perf_counter() - t0
        registry.release(use)
        return seconds

    reads = registry.num_disk_reads
    disk = [into_slot(r) for r in cold]
    host = [into_slot(r) for r in evicted]
    assert registry.num_disk_reads == reads + len(cold), "the evicted adapters were not served from host memory"
    return {"disk_to_slot_s": statistics.median(disk), "host_to_slot_s": statistics.median(host),
            "disk_to_slot_all_s": disk, "host_to_slot_all_s": host}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "qnext-bench"))
    p.add_argument("--json-out")
    args = p.parse_args(argv)

    import qnext
    from qnext.bench.presets import PRESETS, bench_checkpoint
    from qnext.config import ModelConfig
    from qnext.testing.tiny_adapter import write_tiny_adapter

    out = Path(args.out_dir)
    ckpt = bench_checkpoint(args.preset, out)
    vocab = ModelConfig.from_pretrained(ckpt).vocab_size
    root = Path(tempfile.mkdtemp(prefix="qnext-lora-bench-"))
    mix_dirs = [write_tiny_adapter(root / f"mix{i}", ckpt, rank=args.rank, seed=i, scale=0.02)
                for i in range(args.adapters)]
    cold_dirs = [write_tiny_adapter(root / f"cold{i}", ckpt, rank=args.rank, seed=100 + i, scale=0.02)
                 for i in range(4)]
    mix = [qnext.LoRARequest(f"mix{i}", i + 1, str(d)) for i, d in enumerate(mix_dirs)]
    common = dict(dtype=args.dtype, max_num_seqs=args.batch, enable_prefix_caching=False,
                  max_model_len=args.prompt_len + args.max_tokens + 16,
                  max_num_batched_tokens=PRESETS[args.preset].max_num_batched_tokens)
    base = qnext.LLM(ckpt, **common)
    lora = qnext.LLM(ckpt, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                     max_cpu_loras=args.adapters + 4, **common)
    setups = {"base": (base, None), "lora-idle": (lora, None),
              "lora-mix": (lora, [mix[i % len(mix)] for i in range(args.batch)])}
    rng = np.random.default_rng(0)
    for llm, loras in setups.values():                       # compiles every shape the timed passes use
        decode_rate(llm, rng, args, vocab, loras)
    rates = {name: [] for name in setups}
    for _ in range(args.repeats):
        for name, (llm, loras) in setups.items():
            rates[name].append(decode_rate(llm, rng, args, vocab, loras))
    best = {name: max(r) for name, r in rates.items()}
    cold = [qnext.LoRARequest(f"cold{i}", 100 + i, str(d)) for i, d in enumerate(cold_dirs)]
    loads = load_times(lora, cold, mix[:3])
    result = {"preset": args.preset, "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "adapters": args.adapters, "rank": args.rank,
              "decode_tok_s": best, "all_passes": rates, "adapter_load": loads}
    print(f"{args.preset} {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} tokens, "
          f"{args.adapters} adapters of rank {args.rank} on every target (best of {args.repeats} passes)")
    for name, rate in best.items():
        print(f"  {name:10s} decode {rate:8.1f} tok/s  ({rate / best['base']:.2f}x base)")
    print(f"  adapter load (median): disk -> device slot {loads['disk_to_slot_s'] * 1e3:.1f} ms; host memory -> "
          f"device slot {loads['host_to_slot_s'] * 1e3:.1f} ms")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    base.close()
    lora.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
