"""Model runner: lays a schedule out as StepInputs padded to a fixed set of shape buckets, runs the jitted step
with the cache buffers donated, and samples on device.

Buckets (docs/engine.md): decode-only steps use D rows for D in powers of two from 2 up to max_num_seqs; steps with
a prefill use T tokens (powers of two from 16 up to max_num_batched_tokens, 1.5x powers of two from 48, and 1.25x
and 1.75x powers of two from 320) and
ceil(T / C) + extra prefill groups (C = min(prefill_chunk, T) rounded down to a power of two), either prefill-only
or mixed with decode rows. Warm-up compiles every bucket, after which a workload triggers no compilation.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from cache import CacheManager
from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.multi_step import MultiStepInputs, make_multi_step
from qnext.engine.sampler import SamplerInputBuilder, SamplingRow, first_argmax, sample
from qnext.engine.scheduler import ScheduledSequence
from qnext.model.forward import forward
from qnext.model.step_inputs import LayoutSizes, Segment, build_step_inputs, group_bounds, required_sizes
from qnext.model.tensor_parallel import local_config, shard_step
from qnext.sampling_params import SamplingParams


@functools.lru_cache(maxsize=None)
def make_engine_step(cfg: ModelConfig, tensor_parallel_size: int = 1):
    """The model step that also returns the greedy token of every logits row (first_argmax of the raw logits, the
    sampler's own greedy pick): a batch whose rows are all greedy, with no logprobs, penalties or suppressed ids,
    takes its tokens from there and skips the sampler's dispatch and input transfers (bench, tiny model, 16 rows:
    sampling and transfer 0.74 -> 0.3-0.4 ms of a ~3-5 ms step). One per config, so engines of the same model
    share compilations; cache buffers are donated. With tensor_parallel_size > 1 the params and buffers are the
    sharded ones of tensor_parallel.py and each device runs its shard of the step."""
    local = local_config(cfg, tensor_parallel_size)

    def step(params, buffers, inputs):
        logits, buffers = forward(params, buffers, inputs, local)
        return logits, first_argmax(logits), buffers

    return jax.jit(shard_step(step, tensor_parallel_size, 2), donate_argnums=(1,))


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
        self._step = make_engine_step(cfg, config.tensor_parallel_size)
        self._multi_step = (make_multi_step(cfg, config.num_scheduler_steps, config.block_size,
                                            config.tensor_parallel_size)
                            if config.num_scheduler_steps > 1 else None)
        self.sampler_inputs = SamplerInputBuilder(cfg.vocab_size, cfg.eos_token_ids, seed=config.seed)
        # Decode-only buckets start at 2 rows: with a single row XLA turns the row scatters into dynamic updates
        # and copies every donated cache buffer (~10x slower per step).
        prefill_chunk = config.resolved_prefill_chunk()
        self.decode_buckets = [Bucket(LayoutSizes(d, d, 0, self.max_blocks, d), prefill_chunk)
                               for d in _powers_of_two(2, max(2, config.max_num_seqs))]
        self.prefill_buckets, self.mixed_buckets = [], []
        powers = _powers_of_two(16, config.max_num_batched_tokens)
        # Sizes halfway between powers of two (48, 96, ...) too: a prompt's uncached tail (a chat turn) pads to at
        # most 1.33x instead of 2x, and so does the last prefill step of a batch, where the remaining prompt tails
        # join the running decode rows (bench, small model, batch 16: 754 tokens ran as 1024, ~1.2 s).
        halfway = [3 * t // 2 for t in powers if 32 <= t and 3 * t // 2 < powers[-1]]
        # From 256 tokens on, quarter sizes too (320, 448, 640, 896, ...): padding there costs whole milliseconds
        # of matmuls, and the waste drops to at most 1.2x (bench, small model, an 850-token step run as 896 instead
        # of 1024: 0.96-1.06 -> 0.86-0.89 s, side by side). Two compilations per size, only for big step budgets.
        quarters = [q * t // 4 for t in powers for q in (5, 7) if 256 <= t and q * t // 4 < powers[-1]]
        for t in sorted(powers + halfway + quarters):
            # the chunk is a power of two (GPU block shapes)
            chunk = min(prefill_chunk, 1 << (t.bit_length() - 1))
            groups = -(-t // chunk) + min(max(2, t // 64), config.max_prefill_groups_extra)
            logits = min(groups, config.max_num_seqs)
            self.prefill_buckets.append(Bucket(LayoutSizes(t, 0, groups, self.max_blocks, logits), chunk))
            if config.max_num_seqs > 1:                   # one sequence never mixes decode and prefill in a step
                rows = min(max(2, t // 2), config.max_num_seqs)
                self.mixed_buckets.append(Bucket(LayoutSizes(t, rows, groups, self.max_blocks,
                                                             min(rows + groups, config.max_num_seqs)), chunk))
        self.step_time = 0.0              # seconds inside the jitted step alone, for host-overhead stats

    # ---- shapes ----------------------------------------------------------------------------------------------
    def _segments(self, items: list[ScheduledSequence], rows: dict) -> list[Segment]:
        return [Segment(token_ids=it.seq.token_slice(it.start, it.end), start=it.start,
                        block_table=self.cache.block_table(it.seq.request_id), read_row=it.seq.read_row,
                        write_row=it.seq.state_row,
                        captures={p: rows.get((it.seq.request_id, p), 0) for p in it.capture_positions})
                for it in items]

    @property
    def buckets(self) -> list[Bucket]:
        return self.decode_buckets + self.prefill_buckets + self.mixed_buckets

    def bucket_for(self, segments: list[Segment]) -> Bucket | None:
        """The cheapest compiled shape that holds the segments (families are ordered decode, prefill, mixed)."""
        need = {}                                   # required sizes per chunk length: buckets share a few
        for b in self.buckets:
            if b.chunk not in need:
                need[b.chunk] = required_sizes(segments, b.chunk)
            if b.sizes.fits(need[b.chunk]):
                return b
        return None

    def new_layout(self) -> "StepLayout":
        return StepLayout(self)

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
        logits, greedy, self.buffers = self._step(self.params, self.buffers, inputs)
        jax.block_until_ready(logits)            # device time = the jitted step alone (sampling is host-side work)
        self.step_time += time.perf_counter() - t0
        out = {}
        if not sampling:
            return out
        sampling_rows = self._sampling_rows([it for _, it in sampling])
        if self.sampler_inputs.plain_greedy(sampling_rows):
            tokens = np.asarray(greedy).tolist()     # (jax.device_get costs ~40 us more a step)
            for i, it in sampling:              # logprob 0 and rank 1, as the sampler reports without logprobs
                out[it.seq.request_id] = SampledToken(tokens[i], 0.0, 1, None, None)
            return out
        num_rows = bucket.sizes.num_logits
        index = np.zeros(num_rows, np.int32)
        index[:len(sampling)] = [i for i, _ in sampling]
        tensors, num_logprobs = self.sampler_inputs.build(sampling_rows, num_rows)
        result = jax.device_get(_sample_rows(logits, index, tensors, num_logprobs=num_logprobs))
        for j, (_, it) in enumerate(sampling):
            out[it.seq.request_id] = SampledToken(
                int(result.token_ids[j]), float(result.logprobs[j]), int(result.ranks[j]),
                result.top_ids[j] if num_logprobs else None, result.top_logprobs[j] if num_logprobs else None)
        return out

    def multi_step_ok(self, items: list[ScheduledSequence]) -> bool:
        """Whether the step may run as several decode steps in one call: every item decodes, its prompt is
        computed (no prompt capture pending), its sampling needs no per-step host state (no logprobs, penalties
        or suppressed ids) and it has no stop strings (the detokenizer's, which the device cannot check)."""
        if self.config.num_scheduler_steps < 2 or not items:
            return False
        if not all(it.num_tokens == 1 and it.samples and it.start >= len(it.seq.prompt_token_ids)
                   and not it.seq.params.stop for it in items):
            return False
        return self.sampler_inputs.stateless(self._sampling_rows(items))

    @staticmethod
    def _sampling_rows(items: list[ScheduledSequence]) -> list[SamplingRow]:
        return [SamplingRow(it.seq.request_id, it.seq.params, it.seq.prompt_token_ids, it.seq.output_token_ids,
                            it.seq.request_index) for it in items]

    def execute_multi(self, items: list[ScheduledSequence], steps: list[int], captures: list[dict[int, int]],
                      stop_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Runs up to num_scheduler_steps decode steps in one call (see multi_step.py). Per item: `steps` tokens
        at most, `captures` {step: snapshot row} and the token ids that stop it. The items' block tables must
        already hold every token they may run. Returns (tokens [K, items], ran [items]): item i's tokens are
        tokens[:ran[i], i]."""
        segments = self._segments(items, {})            # captures come per step, from the plan
        bucket = self.bucket_for(segments)
        sizes = bucket.sizes
        assert sizes.num_chunks == 0 and sizes.num_decode == sizes.num_tokens, "a multi-step call needs a decode bucket"
        inputs = build_step_inputs(segments, sizes, block_size=self.config.block_size, chunk=bucket.chunk)
        d, m = sizes.num_decode, len(items)
        width = 4
        while width < max(len(ids) for ids in stop_ids):     # a few widths, each one compilation
            width *= 2
        plan = MultiStepInputs.idle(self.config.num_scheduler_steps, d, width)
        plan.steps[:m] = steps
        for i, (rows, ids) in enumerate(zip(captures, stop_ids)):
            for step, row in rows.items():
                plan.capture_row[step, i] = row
            plan.stop_ids[i, :len(ids)] = ids
        rows = self._sampling_rows(items)
        sampling = None if all(r.params.greedy for r in rows) else self.sampler_inputs.build(rows, d)[0]
        t0 = time.perf_counter()
        tokens, ran, self.buffers = self._multi_step(self.params, self.buffers, inputs, plan, sampling)
        tokens, ran = np.asarray(tokens)[:, :m], np.asarray(ran)[:m]
        self.step_time += time.perf_counter() - t0
        return tokens, ran

    def free(self, request_id: str) -> None:
        self.sampler_inputs.free(request_id)

    def warm_up(self, on_bucket=None) -> int:
        """Compiles the step for every bucket (and the common sampler variants); `on_bucket()` is called after
        each. Returns the bucket count."""
        for bucket in self.buckets:
            s = bucket.sizes
            decode = min(s.num_decode, s.num_logits - (1 if s.num_chunks else 0), s.num_tokens - 2)
            segments = [Segment([0], 0, [0], -1, 0) for _ in range(decode)]
            if s.num_chunks:
                segments.append(Segment([0] * 2, 0, [0], -1, 0))
            inputs = build_step_inputs(segments, s, block_size=self.config.block_size, chunk=bucket.chunk)
            logits, _, self.buffers = self._step(self.params, self.buffers, inputs)
            if self._multi_step is not None and not s.num_chunks:     # decode buckets also run multi-step
                plan = MultiStepInputs.idle(self.config.num_scheduler_steps, s.num_decode)
                _, _, self.buffers = self._multi_step(self.params, self.buffers, inputs, plan, None)  # runs no step
                tensors, _ = self.sampler_inputs.build([SamplingRow("warm-up", _WARM_UP_SAMPLING[1], [0], [], 0)],
                                                       s.num_decode)
                _, _, self.buffers = self._multi_step(self.params, self.buffers, inputs, plan, tensors)
                self.sampler_inputs.free("warm-up")
            for params in _WARM_UP_SAMPLING:     # the sampler variants most requests use
                tensors, k = self.sampler_inputs.build([SamplingRow("warm-up", params, [0], [], 0)], s.num_logits)
                jax.block_until_ready(_sample_rows(logits, np.zeros(s.num_logits, np.int32), tensors, num_logprobs=k))
                self.sampler_inputs.free("warm-up")
            if on_bucket is not None:
                on_bucket()
        return len(self.buckets)


class StepLayout:
    """Running totals of the step being scheduled: `try_add` keeps an item only if the step still fits a compiled
    shape. Totals are additive per item (every bucket's block table spans max_model_len), so each check is
    O(buckets)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.tokens = self.decode = self.segments = 0
        self.groups = {b.chunk: 0 for b in runner.prefill_buckets}
        self.all_decode = True

    def try_add(self, item: ScheduledSequence) -> bool:
        decode = item.num_tokens == 1
        groups = {c: n + (0 if decode else len(group_bounds(item.start, item.end, item.capture_positions, c)))
                  for c, n in self.groups.items()}
        tokens, num_decode, segments = self.tokens + item.num_tokens, self.decode + decode, self.segments + 1
        all_decode = self.all_decode and decode
        fits = all_decode and any(b.sizes.num_decode >= num_decode for b in self.runner.decode_buckets)
        fits = fits or any(b.sizes.num_tokens >= tokens and b.sizes.num_decode >= num_decode
                           and b.sizes.num_chunks >= groups[b.chunk] and b.sizes.num_logits >= segments
                           for b in self.runner.prefill_buckets + self.runner.mixed_buckets)
        if fits:
            self.tokens, self.decode, self.segments, self.all_decode = tokens, num_decode, segments, all_decode
            self.groups = groups
        return fits
