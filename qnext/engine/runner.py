"""Model runner: lays a schedule out as StepInputs padded to a fixed set of shape buckets, runs the jitted step
with the cache buffers donated, and samples on device.

Buckets: decode-only steps use D rows for D in powers of two up to max_num_seqs; any step with a prefill uses a
mixed bucket of T tokens (powers of two from 16 up to max_num_batched_tokens) with min(T, max_num_seqs) decode
rows and T // C + extra prefill groups (C = min(prefill_chunk, T)). Warm-up compiles every bucket, after which a
workload triggers no compilation.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from cache import CacheManager
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.sampler import SamplerInputBuilder, SamplingRow, sample
from qnext.engine.scheduler import ScheduledSequence
from cache.device_buffers import CacheBuffers
from qnext.model.forward import make_step
from qnext.model.step_inputs import LayoutSizes, Segment, build_step_inputs, required_sizes
from qnext.sampling_params import SamplingParams

@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def _sample_rows(logits, index, tensors, num_logprobs):
    """Sample from the logits rows `index` ([M] int32; the step returns one row per segment) in one dispatch."""
    return sample(logits[index], tensors, num_logprobs=num_logprobs)


_WARM_UP_SAMPLING = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9))


@dataclasses.dataclass(frozen=True)
class Bucket:
    sizes: LayoutSizes
    chunk: int


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    rank: int
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, n = [], 1
    while n < hi:
        if n >= lo:
            out.append(n)
        n *= 2
    return out + [n]


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, buffers: CacheBuffers, config: EngineConfig, max_model_len: int,
                 cache: CacheManager):
        self.cfg = cfg
        self.params = params
        self.buffers = buffers
        self.config = config
        self.cache = cache
        self.max_blocks = -(-max_model_len // config.block_size)
        self._step = make_step(cfg)
        self.sampler_inputs = SamplerInputBuilder(cfg.vocab_size, cfg.eos_token_ids, seed=config.seed)
        self.decode_buckets = [Bucket(LayoutSizes(d, d, 0, self.max_blocks, d), config.prefill_chunk)
                               for d in _powers_of_two(1, config.max_num_seqs)]
        self.mixed_buckets = []
        for t in _powers_of_two(16, config.max_num_batched_tokens):
            chunk = min(config.prefill_chunk, t)
            rows = min(t, config.max_num_seqs)
            sizes = LayoutSizes(t, rows, t // chunk + config.max_prefill_groups_extra, self.max_blocks, rows)
            self.mixed_buckets.append(Bucket(sizes, chunk))
        self.step_time = 0.0              # seconds inside the jitted step + sampler, for host-overhead stats

    # ---- shapes ----------------------------------------------------------------------------------------------
    def _segments(self, items: list[ScheduledSequence], rows: dict | None = None) -> list[Segment]:
        segments = []
        for it in items:
            seq = it.seq
            captures = {p: (rows or {}).get((seq.request_id, p), 0) for p in it.capture_positions}
            segments.append(Segment(token_ids=seq.token_ids[it.start:it.end], start=it.start,
                                    block_table=self.cache.block_table(seq.request_id) if rows is not None
                                    else [0] * (-(-it.end // self.config.block_size)),
                                    read_row=seq.read_row, write_row=seq.state_row, captures=captures))
        return segments

    def bucket_for(self, segments: list[Segment]) -> Bucket | None:
        if all(len(s.token_ids) == 1 for s in segments):
            for b in self.decode_buckets:
                if b.sizes.fits(required_sizes(segments, b.chunk)):
                    return b
        for b in self.mixed_buckets:
            if b.sizes.fits(required_sizes(segments, b.chunk)):
                return b
        return None

    def fits(self, items: list[ScheduledSequence]) -> bool:
        return self.bucket_for(self._segments(items)) is not None

    # ---- execution -------------------------------------------------------------------------------------------
    def execute(self, items: list[ScheduledSequence]) -> dict[str, SampledToken]:
        rows = {}
        for it in items:
            seq = it.seq
            for p in it.capture_positions:
                row = (self.cache.reserve_capture(seq.request_id, p) if p in seq.capture_positions
                       else self.cache.decode_capture_row(seq.request_id, p))
                if row is not None:
                    rows[(seq.request_id, p)] = row
        segments = self._segments(items, rows)
        bucket = self.bucket_for(segments)
        inputs = build_step_inputs(segments, bucket.sizes, block_size=self.config.block_size, chunk=bucket.chunk)

        sampling = [(i, it) for i, it in enumerate(items) if it.samples]
        t0 = time.perf_counter()
        logits, self.buffers = self._step(self.params, self.buffers, inputs)
        out = {}
        if sampling:
            num_rows = bucket.sizes.num_logits
            index = np.zeros(num_rows, np.int32)
            index[:len(sampling)] = [i for i, _ in sampling]
            sampling_rows = [SamplingRow(it.seq.request_id, it.seq.params, it.seq.prompt_token_ids,
                                         it.seq.output_token_ids, it.seq.request_index) for _, it in sampling]
            tensors, num_logprobs = self.sampler_inputs.build(sampling_rows, num_rows)
            result = jax.device_get(_sample_rows(logits, index, tensors, num_logprobs=num_logprobs))
            for j, (_, it) in enumerate(sampling):
                out[it.seq.request_id] = SampledToken(
                    int(result.token_ids[j]), float(result.logprobs[j]), int(result.ranks[j]),
                    result.top_ids[j] if num_logprobs else None, result.top_logprobs[j] if num_logprobs else None)
        else:
            jax.block_until_ready(self.buffers)
        self.step_time += time.perf_counter() - t0
        return out

    def free(self, request_id: str) -> None:
        self.sampler_inputs.free(request_id)

    def warm_up(self, on_bucket=None) -> int:
        """Compiles the step for every bucket (and the greedy sampler per row count); `on_bucket()` is called
        after each. Returns the bucket count."""
        for bucket in self.decode_buckets + self.mixed_buckets:
            s = bucket.sizes
            segments = [Segment([0], 0, [0], -1, 0) for _ in range(s.num_decode)]
            if s.num_chunks:
                segments = segments[:max(0, s.num_decode - 1)] + [Segment([0] * 2, 0, [0], -1, 0)]
            inputs = build_step_inputs(segments, s, block_size=self.config.block_size, chunk=bucket.chunk)
            logits, self.buffers = self._step(self.params, self.buffers, inputs)
            for params in _WARM_UP_SAMPLING:     # the sampler variants most requests use
                tensors, k = self.sampler_inputs.build([SamplingRow("warm-up", params, [0], [], 0)], s.num_logits)
                jax.block_until_ready(_sample_rows(logits, np.zeros(s.num_logits, np.int32), tensors, num_logprobs=k))
                self.sampler_inputs.free("warm-up")
            if on_bucket is not None:
                on_bucket()
        return len(self.decode_buckets) + len(self.mixed_buckets)

