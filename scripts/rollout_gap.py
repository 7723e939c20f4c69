"""How far the engine's rollouts are today from being exact: one target request's tokens and reported logprobs
(SamplingParams(logprobs=0): the sampled token's own log-prob) under different schedules, and against the Flax
model's scoring of the same prompt + completion (qnext.flax.token_logprobs), the number a trainer computes.

    python scripts/rollout_gap.py [--model DIR] [--prompt-len 300] [--max-tokens 24] [--dtypes float32 bfloat16]

Cases, each for greedy and for temperature 1 with a seed: alone (cold, a large prefill budget) is the baseline;
then in a batch of 8 (7 random companions), a prefix-cache hit (the same request again on the warm engine), a
small prefill budget (max_num_batched_tokens=32: the prompt prefilled in chunks), and the Flax scoring. Prints max
|Δlogprob| over the completion and whether the tokens agree; "bitwise" when the logprobs are identical.
The default checkpoint is the tiny random qwen3_5 one (qnext/testing/tiny_checkpoint.py), on whatever backend JAX
picks (JAX_PLATFORMS=cpu for the CPU numbers of docs/determinism.md).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMPANIONS = 7
SMALL_BUDGET = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: a tiny random qwen3_5 checkpoint)")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0, help="draws the prompts and the companions")
    return p.parse_args(argv)


def completion(output):
    """(token ids, engine-reported log-prob of each) of a RequestOutput's first completion."""
    import numpy as np

    c = output.outputs[0]
    return list(c.token_ids), np.array([entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)], np.float32)


def sampling(temperature: float, max_tokens: int):
    from qnext import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=1234)


def measure(model, prompt, companions, max_tokens: int, temperature: float):
    """{case: (tokens, logprobs)} for the target prompt under each schedule, plus "flax": the Flax model's scores
    of the baseline's prompt + completion."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import qnext
    import qnext.flax as qflax

    params = sampling(temperature, max_tokens)
    target = {"prompt_token_ids": list(prompt)}
    runs = {}
    common = dict(max_num_seqs=COMPANIONS + 1, max_model_len=len(prompt) + max_tokens + 16,
                  compilation_cache_dir="none")
    llm = qnext.LLM.from_model(model, max_num_batched_tokens=512, **common)
    try:
        runs["alone, cold"] = completion(llm.generate([target], params)[0])
        again = llm.generate([target], params)[0]
        assert again.num_cached_tokens > 0, "the rerun found no prefix-cache hit"
        runs["prefix-cache hit"] = completion(again)
    finally:
        llm.close()
    llm = qnext.LLM.from_model(model, max_num_batched_tokens=512, enable_prefix_caching=False, **common)
    try:
        others = [{"prompt_token_ids": list(c)} for c in companions]
        runs[f"batch of {len(companions) + 1}"] = completion(llm.generate([target] + others, params)[0])
    finally:
        llm.close()
    llm = qnext.LLM.from_model(model, max_num_batched_tokens=SMALL_BUDGET, enable_prefix_caching=False, **common)
    try:
        runs[f"prefill budget {SMALL_BUDGET}"] = completion(llm.generate([target], params)[0])
    finally:
        llm.close()
    tokens = runs["alone, cold"][0]
    ids = jnp.asarray([list(prompt) + tokens], jnp.int32)
    scores = np.asarray(nnx.jit(qflax.token_logprobs)(model, ids))[0, len(prompt) - 1:]
    runs["flax token_logprobs"] = (tokens, scores)
    return runs


def report(runs, label: str) -> list[str]:
    import numpy as np

    base_tokens, base = runs["alone, cold"]
    lines = []
    for case, (tokens, logprobs) in runs.items():
        if case == "alone, cold":
            continue
        same = tokens == base_tokens
        n = len(base) if same else next(i for i, (a, b) in enumerate(zip(tokens, base_tokens)) if a != b)
        delta = float(np.abs(logprobs[:n] - base[:n]).max()) if n else float("nan")
        exact = " (bitwise)" if same and np.array_equal(logprobs, base) else ""
        lines.append(f"{label:<26} {case:<22} tokens {'equal' if same else f'differ from {n}':<14} "
                     f"max|Δlogprob| {delta:.3g}{exact}")
    return lines


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    import numpy as np

    import qnext.flax as qflax

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

            path = write_tiny_checkpoint(Path(tmp) / "tiny", "qwen3_5")
        lines = []
        for dtype in args.dtypes:
            model = qflax.from_pretrained(path, dtype=dtype)
            rng = np.random.default_rng(args.seed)
            vocab = model.config.vocab_size
            prompt = rng.integers(0, vocab, args.prompt_len).tolist()
            companions = [rng.integers(0, vocab, int(rng.integers(8, args.prompt_len))).tolist()
                          for _ in range(COMPANIONS)]
            for temperature in (0.0, 1.0):
                runs = measure(model, prompt, companions, args.max_tokens, temperature)
                label = f"{dtype}, {'greedy' if temperature == 0 else 'temperature 1'}"
                for line in report(runs, label):
                    print(line, flush=True)
                    lines.append(line)
    return lines


if __name__ == "__main__":
    main()
