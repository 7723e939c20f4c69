"""What MTP speculative decoding can buy on this machine: the measured cost of a verify step (k + 1 new tokens of one
sequence, the shape the engine's step runs them in today) against a plain decode step at batch 1, and the speedup
expected from an acceptance length A (tokens emitted per verify round, scripts/train_mtp.py measures it):

    speedup(A) = A * t_decode / (t_verify(k + 1) + k * t_draft)

t_draft is estimated from t_decode scaled by the MTP head's share of the weights a decode step reads (one
full-attention layer with the model's MLP, fc, and the shared lm_head, against the whole model): batch-1 decode is
bandwidth-bound, so its time follows the bytes read.

    python scripts/bench_mtp.py [--preset small] [--k 2] [--acceptance-length 1.6]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=48)
    p.add_argument("--acceptance-length", type=float, default=None, help="measured A to evaluate (optional)")
    return p.parse_args(argv)


def timed_steps(llm, prompt: list[int], max_tokens: int) -> tuple[list[float], list[float]]:
    """(prefill step seconds, decode step seconds) of one request run alone, step by step."""
    from qnext import SamplingParams

    engine = llm.engine
    engine.add_request("probe", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    seq = engine.requests["probe"]
    prefill, decode = [], []
    while engine.has_unfinished_requests():
        in_prefill = seq.num_computed_tokens < len(prompt) - 1
        t0 = time.perf_counter()
        engine.step()
        (prefill if in_prefill else decode).append(time.perf_counter() - t0)
    engine.release("probe")
    return prefill, decode


def head_share(cfg) -> float:
    """The MTP head's weight bytes over the model's (both count the lm_head once)."""
    from qnext.model.weights import param_specs

    specs = param_specs(cfg, "float32")
    sizes = lambda tree: [int(np.prod(s.shape)) for s in _leaves(tree)]  # noqa: E731
    layers = specs["layers"]
    last_full = max(i for i in range(cfg.num_hidden_layers) if not cfg.is_linear_layer(i))
    head = sum(sizes(layers[last_full])) + 2 * cfg.hidden_size ** 2 + int(np.prod(specs["lm_head"].shape))
    return head / sum(sizes(specs))


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def main(argv=None) -> dict:
    args = parse_args(argv)
    from qnext import LLM
    from qnext.bench.presets import bench_checkpoint

    path = bench_checkpoint(args.preset, args.out_dir)
    k = args.k
    # a step budget of k + 1 tokens: the prompt is prefilled k + 1 tokens a step, each step a verify-shaped step
    llm = LLM(path, max_num_seqs=1, max_num_batched_tokens=k + 1, enable_prefix_caching=False,
              max_model_len=args.prompt_len + args.decode_steps + 8)
    cfg = llm.engine.model_config
    rng = np.random.default_rng(0)
    timed_steps(llm, rng.integers(3, cfg.vocab_size, args.prompt_len).tolist(), 8)          # compile
    prefill, decode = timed_steps(llm, rng.integers(3, cfg.vocab_size, args.prompt_len).tolist(), args.decode_steps)
    t_verify, t_decode = float(np.median(prefill[2:])), float(np.median(decode[2:]))
    t_draft = head_share(cfg) * t_decode
    print(f"{args.preset}: batch 1, context ~{args.prompt_len} tokens; medians of {len(prefill) - 2} verify-shaped "
          f"and {len(decode) - 2} decode steps")
    print(f"decode step {t_decode * 1e3:.1f} ms; step of k+1={k + 1} tokens {t_verify * 1e3:.1f} ms "
          f"({t_verify / t_decode:.2f}x); MTP draft (estimated, {head_share(cfg):.0%} of the weights) "
          f"{t_draft * 1e3:.1f} ms")
    round_cost = t_verify + k * t_draft
    print("acceptance length -> expected batch-1 decode speedup:")
    for a in sorted({1.0, 1.5, 2.0, 2.5, float(k + 1)} | ({args.acceptance_length} if args.acceptance_length else set())):
        if a <= k + 1:
            print(f"  A = {a:.2f}: {a * t_decode / round_cost:.2f}x")
    need = 1.5 * round_cost / t_decode
    print(f"1.5x needs A >= {need:.2f} tokens per round (at most {k + 1} with k={k})")
    return {"t_decode": t_decode, "t_verify": t_verify, "t_draft": t_draft, "acceptance_for_1_5x": need}


if __name__ == "__main__":
    main()
