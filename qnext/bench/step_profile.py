"""Offline passes through an engine, timed per request and per step from the engine's own counters
(EngineStats): TTFT, TPOT, where each step's time goes, and what the prefix cache reused."""
from __future__ import annotations

import dataclasses
import time


class StepProfile:
    """Per engine step: its wall time and its phases, read from the engine's own counters (EngineStats): schedule,
    layout (StepInputs), device (the jitted step until its results are ready), sample, postprocess; plus the
    sequences and tokens it ran and how many model steps (a multi-step call runs several)."""

    PARTS = ("schedule", "layout", "device", "sample", "postprocess")
    _COUNTERS = tuple(f"{p}_seconds" for p in PARTS) + ("num_scheduled_sequences", "num_scheduled_tokens",
                                                         "num_model_steps")

    def __init__(self, engine):
        self.engine = engine
        self.records: list[dict] = []

    def step(self):
        stats = self.engine.stats
        before = {k: getattr(stats, k) for k in self._COUNTERS}
        t0 = time.perf_counter()
        outputs = self.engine.step()
        record = {"step": time.perf_counter() - t0}
        delta = {k: getattr(stats, k) - before[k] for k in self._COUNTERS}
        record.update({p: delta[f"{p}_seconds"] for p in self.PARTS})
        record.update(rows=delta["num_scheduled_sequences"], tokens=delta["num_scheduled_tokens"],
                      steps=delta["num_model_steps"])
        if record["rows"]:
            self.records.append(record)
        return outputs


def run_qnext(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """All prompts at once, stepped to completion; per-request TTFT and TPOT from the step that produced them."""
    from qnext.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    compiled = engine.stats.num_compilations
    profile = StepProfile(engine)
    cache0 = dataclasses.asdict(engine.cache_stats)
    t0 = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    first, done, tokens = {}, {}, {}
    try:
        while engine.has_unfinished_requests():
            outs = profile.step()
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, now)
                if o.finished:
                    done[o.request_id] = now
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
    finally:
        for rid in ids:
            engine.release(rid)
    total = max(done.values()) - t0
    compiled = engine.stats.num_compilations - compiled
    cache1 = dataclasses.asdict(engine.cache_stats)
    return {
        "seconds": total,
        "output_tokens_per_s": len(prompts) * output_len / total,
        "ttft_s": [first[r] - t0 for r in ids],
        "tpot_s": [(done[r] - first[r]) / (output_len - 1) for r in ids],
        "tokens": [tokens[r] for r in ids],
        "steps": profile.records,
        "compilations": compiled,
        "cache": {k: cache1[k] - cache0[k] for k in ("prompt_tokens", "reused_tokens", "kv_matched_tokens",
                                                     "lost_to_missing_state_tokens", "snapshots_captured",
                                                     "snapshots_restored")},
    }


def host_summary(steps: list[dict], decode_rows: int | None = None) -> dict:
    """Means per model step (an engine step that ran several decode steps in one call counts as that many);
    with decode_rows, only the decode-only steps of exactly that many sequences."""
    if decode_rows is not None:
        steps = [s for s in steps if s["rows"] == decode_rows and s["tokens"] == decode_rows]
    if not steps:
        return {}
    count = sum(max(1, s["steps"]) for s in steps)
    mean = {k: float(sum(s[k] for s in steps) / count) for k in StepProfile.PARTS + ("step",)}
    host = mean["step"] - mean["device"]
    # the fastest call of the most steps per call: a rate sustained over a few steps, as the bandwidth reader's is
    most = max(max(1, s["steps"]) for s in steps)
    fastest = min(s["step"] / most for s in steps if max(1, s["steps"]) == most)
    return {"num_steps": count, **{f"{k}_s": v for k, v in mean.items()},
            "host_s": host, "host_fraction": host / mean["step"], "step_s_fastest_call": fastest,
            "steps_per_call": most}
