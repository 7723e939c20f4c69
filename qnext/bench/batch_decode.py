"""One batch of requests stepped to the end on an engine, with its decode steps timed apart from the prefill steps
(for the drafting benches: scripts/bench_suffix.py, bench_grammar_ff.py)."""
from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class BatchRun:
    outputs: list           # each request's final CompletionOutput, in the order of the prompts
    steps: int              # engine steps, prefill included
    decode_steps: int       # steps that prefilled nothing (plain decode or a verify window)
    decode_tokens: int      # tokens those steps generated, every row together
    decode_wall_s: float    # their wall time

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_wall_s if self.decode_wall_s else 0.0

    def tokens_per_step(self, rows: int) -> float:
        """Generated tokens per decode step per row."""
        return self.decode_tokens / self.decode_steps / rows if self.decode_steps else 0.0


def run_batch(engine, prompts: list[list[int]], params) -> BatchRun:
    """Adds every prompt (token ids) with `params`, steps until all finish, releases them."""
    stats = engine.stats
    ids = [f"r{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    outputs, steps, decode_steps, decode_tokens, decode_wall = {}, 0, 0, 0, 0.0
    while engine.has_unfinished_requests():
        prefill, generated = stats.num_prefill_tokens, stats.num_generated_tokens
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
        steps += 1
        if stats.num_prefill_tokens == prefill:          # a decode step (plain or verify)
            decode_wall += time.perf_counter() - t0
            decode_steps += 1
            decode_tokens += stats.num_generated_tokens - generated
    for rid in ids:
        engine.release(rid)
    return BatchRun([outputs[rid] for rid in ids], steps, decode_steps, decode_tokens, decode_wall)
