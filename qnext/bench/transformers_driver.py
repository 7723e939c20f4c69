"""The transformers side of the engine benchmark: a checkpoint loaded with transformers, one batched greedy
`generate` timed per step, and the agreement of two engines' tokens; plus the benchmark's random prompts."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np

from qnext.optional import optional_import


def load_hf(path: Path, dtype: str, threads: int):
    torch = optional_import("torch", "reference", "the transformers side of the benchmark")
    transformers = optional_import("transformers", "reference", "the transformers side of the benchmark")

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.eval()


def run_hf(model, prompts: list[list[int]], output_len: int, pad_id: int) -> dict:
    """One batched generate, left-padded with an attention mask; a logits processor stamps every step."""
    torch = optional_import("torch", "reference", "the transformers side of the benchmark")
    transformers = optional_import("transformers", "reference", "the transformers side of the benchmark")
    LogitsProcessor, LogitsProcessorList = transformers.LogitsProcessor, transformers.LogitsProcessorList

    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    # qnext's requests use ignore_eos: an EOS neither stops a request nor is suppressed. generate does the same when
    # its EOS id is one no step can produce (min_new_tokens would instead mask every EOS id, and the two engines'
    # greedy outputs would part wherever an EOS was the argmax; None falls back to the model's EOS ids).
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = model.config.get_text_config().vocab_size
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, do_sample=False,
                             max_new_tokens=output_len, pad_token_id=pad_id,
                             logits_processor=LogitsProcessorList([Stamp()]))
    total = time.perf_counter() - t0
    if out.shape[1] - width != output_len:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {output_len}")
    ttft = stamps[0] - t0
    return {"seconds": total, "output_tokens_per_s": len(prompts) * output_len / total,
            "ttft_s": [ttft] * len(prompts), "tpot_s": [(total - ttft) / (output_len - 1)] * len(prompts),
            "tokens": out[:, width:].tolist()}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / len(x) for x, y in zip(a, b)]
    return {"identical_outputs": same / len(a), "mean_matching_prefix": float(np.mean(prefix))}


def random_prompts(rng, n: int, lens: tuple[int, int], vocab: int) -> list[list[int]]:
    return [rng.integers(3, vocab - 8, int(rng.integers(lens[0], lens[1] + 1))).tolist() for _ in range(n)]
