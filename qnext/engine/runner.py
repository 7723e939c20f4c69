"""Model runner: lays a StepPlan out as StepInputs of its bucket, runs the jitted step with the plan's cache buffers
donated, and samples on device. Two paths: a single step, and a window step that gives each decoding row several
tokens (multi_step.MultiStep, or the MTP drafter's speculative step: drafter.py, handed in by the engine). It holds
the params and the compiled steps; it never sees the cache manager."""
from __future__ import annotations

import functools
import logging
import time

import jax
import numpy as np

from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.context_parallel_prefill import ContextParallelPrefill
from qnext.engine.drafter import Drafter
from qnext.engine.multi_step import MultiStep
from qnext.engine.plan import ScheduledSequence, StepPlan, StepResult
from qnext.engine.sampled_token import SampledToken
from qnext.engine.sampler import sample
from qnext.engine.sampling_inputs import SamplerInputBuilder, SamplingRow
from qnext.engine.stats import EngineStats
from qnext.engine.window import WindowInputs, window_inputs
from qnext.model.argmax import first_argmax
from qnext.model.buckets import BucketTable
from qnext.model.forward import forward, forward_with_hidden
from qnext.lora.adapter_stacks import AdapterStacks
from qnext.model.step_inputs import Segment, build_step_inputs
from qnext.model.tensor_parallel import local_config, shard_step, sharded_model_config
from qnext.sampling_params import SamplingParams
from qnext.structured.matcher import bitmask_words, fill_bitmask, fill_window_bitmask
from qnext.structured.thinking_budget import force_rows


logger = logging.getLogger("qnext.engine")

# activation_bytes' second compile: this many more KV blocks and state rows (shapes only, nothing is allocated),
# and the growth of the temporaries under which it is noise (alignment), not a copy of a cache buffer
_PROBE_BLOCKS, _PROBE_ROWS, _PROBE_NOISE_BYTES = 256, 8, 1 << 16


@functools.lru_cache(maxsize=None)
def make_engine_step(cfg: ModelConfig, tensor_parallel_size: int = 1, with_hidden: bool = False):
    """The model step that also returns the greedy token of every logits row (first_argmax of the raw logits, the
    sampler's own greedy pick), so that a batch of plain greedy rows skips the sampler's dispatch (docs/engine.md).
    One per config, so engines of the same model share compilations; cache buffers are donated. With
    tensor_parallel_size > 1 the params and buffers are the sharded ones and each device runs its shard.
    with_hidden (MTP drafting, one device): (logits, greedy, hidden [T, H] final-normed, buffers)."""
    if with_hidden:
        def step_with_hidden(params, buffers, inputs):
            logits, hidden, buffers = forward_with_hidden(params, buffers, inputs, cfg)
            return logits, first_argmax(logits), hidden, buffers

        return jax.jit(step_with_hidden, donate_argnums=(1,))
    local = local_config(cfg, tensor_parallel_size)

    def step(params, buffers, inputs):
        logits, buffers = forward(params, buffers, inputs, local)
        return logits, first_argmax(logits), buffers

    return jax.jit(shard_step(step, cfg, tensor_parallel_size, 2), donate_argnums=(1,))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def _sample_rows(logits, index, tensors, num_logprobs):
    """Sample from the logits rows `index` ([M] int32; the step returns one row per segment) in one dispatch."""
    return sample(logits[index], tensors, num_logprobs=num_logprobs)


# The sampler variants warm-up compiles: plain sampling (the OpenAI APIs' default, temperature 1 and top_p 1) and
# top-p. Plain greedy rows take the step's own argmax; the rarer variants (logprobs, penalties, min_tokens, grammar
# masks) compile on first use.
_WARM_UP_SAMPLING = (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9))


def _sampling_rows(items: list[ScheduledSequence]) -> list[SamplingRow]:
    return [SamplingRow(it.seq.request_id, it.seq.params, it.seq.prompt_token_ids, it.seq.output_token_ids,
                        it.seq.request_index) for it in items]


def _drawing(plan: StepPlan) -> list[tuple[int, ScheduledSequence]]:
    """(logits row, item) of every token this step draws: each sampling item, then the forks that draw their
    first token from a sampling item's logits (n > 1; one row per sample, each with its own seed stream)."""
    sampling = [(i, it) for i, it in enumerate(plan.items) if it.samples]
    forks = [(i, ScheduledSequence(child, it.segment, True)) for i, it in sampling for child in it.forks]
    return sampling + forks


def _num_sampler_rows(plan: StepPlan, num_drawing: int) -> int:
    """The sampler's padded batch: the bucket's logits rows, or more when forks draw too."""
    return max(plan.bucket.sizes.num_logits, 1 << (num_drawing - 1).bit_length())


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, config: EngineConfig, buckets: BucketTable, stats: EngineStats,
                 drafter: Drafter | None = None, visual_encoder=None, lora: AdapterStacks | None = None):
        """drafter: the MTP head's (drafter.py) or the host's (suffix_drafter.py) when the engine speculates.
        visual_encoder: the vision tower's (visual_encoder.py) when the checkpoint has one; steps with pictures get
        its outputs and MRoPE positions. lora: the LoRA adapters on device (engine option enable_lora); each token
        uses its segment's slot."""
        self.lora = lora
        self.cfg = cfg
        self.params = params
        self.config = config
        self.buckets = buckets
        self.stats = stats
        self.drafter = drafter
        self.visual_encoder = visual_encoder
        self._hidden = drafter is not None and drafter.uses_hidden_states      # MTP: the head reads them
        self._step = make_engine_step(cfg, config.tensor_parallel_size, with_hidden=self._hidden)
        # several tokens a row in one call: the drafter's speculative step, or num_scheduler_steps decode steps (both
        # with grammar fast-forward alone, whose drafter verifies only the windows of forced tokens)
        self._multi = MultiStep(cfg, config) if config.num_scheduler_steps > 1 else None
        self.sampler_inputs = SamplerInputBuilder(cfg.vocab_size, cfg.eos_token_ids, seed=config.seed)
        self.context_parallel = ContextParallelPrefill(cfg, config) if config.context_parallel_size > 1 else None
        self.params = params if self.context_parallel is None else self.context_parallel.place(params)   # replicated

    def execute(self, plan: StepPlan) -> StepResult:
        result = self._execute_single(plan) if plan.multi is None else self._execute_window(plan)
        if self.drafter is not None:
            result.drafts = self.drafter.propose(plan, result)
        return result

    def _execute_single(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        inputs = build_step_inputs([it.segment for it in plan.items], plan.bucket.sizes,
                                   block_size=self.config.block_size, chunk=plan.bucket.chunk,
                                   with_lora=self.lora is not None)
        if self.visual_encoder is not None:
            inputs = self.visual_encoder.attach(plan.items, inputs)
        t1 = time.perf_counter()
        hidden = None
        split = self.context_parallel.run(self.params, plan) if self.context_parallel is not None else None
        if split is not None:
            logits, greedy, buffers = split
        elif self._hidden:
            logits, greedy, hidden, buffers = self._step(self._step_params(), plan.buffers, inputs)
        else:
            logits, greedy, buffers = self._step(self._step_params(), plan.buffers, inputs)
        bitmask = self._token_bitmask(plan)          # on the host while the device runs the step
        jax.block_until_ready(logits)
        t2 = time.perf_counter()
        result = StepResult(buffers, self._sample(plan, logits, greedy, bitmask))
        t3 = time.perf_counter()
        if hidden is not None:
            result.buffers, result.drafts = self.drafter.catch_up(self.params, plan, inputs, hidden, result)
        self.stats.add_phases(layout=t1 - t0, device=t2 - t1 + time.perf_counter() - t3, sample=t3 - t2,
                              model_steps=1)
        return result

    def _execute_window(self, plan: StepPlan) -> StepResult:
        """Several tokens for each decoding item in one call: a speculative step verifying the items' drafts, or
        num_scheduler_steps decode steps (plan.multi: budgets, captures, stop ids). Item i keeps tokens[:ran[i], i]."""
        t0 = time.perf_counter()
        d, m = plan.bucket.sizes.num_decode, len(plan.items)
        runs = self.drafter if plan.speculative else self._multi
        window = window_inputs(plan.multi, plan.drafts, d, runs.width)
        inputs = runs.layout(plan.items, plan.bucket, window)
        if plan.speculative:                     # grammar rows: a mask per window position
            window = window.replace(token_bitmask=self._window_bitmask(plan, window, inputs))
        if self.visual_encoder is not None and not plan.speculative:
            inputs = self.visual_encoder.attach(plan.items, inputs, embeds=False)   # MRoPE positions of rows
            # with pictures
        rows = _sampling_rows(plan.items)       # greedy rows with penalties need their tensors too
        sampling, num_logprobs = (None, None) if self.sampler_inputs.plain_greedy(rows) else \
            self.sampler_inputs.build(rows, d)
        t1 = time.perf_counter()
        tokens, ran, buffers, drafts, logprobs = runs.run(self.params, plan.buffers, inputs, window, sampling,
                                                          num_logprobs)
        tokens, ran = np.asarray(tokens)[:m].T, np.asarray(ran)[:m]
        if logprobs is not None:                 # [D, W, ...] -> [W, items, ...], as tokens
            logprobs = jax.tree.map(lambda x: np.swapaxes(x[:m], 0, 1), jax.device_get(logprobs))
        result = StepResult(buffers, tokens=tokens, ran=ran, logprobs=logprobs)
        if plan.speculative:
            result.drafts = dict(zip([it.seq.request_id for it in plan.items], np.asarray(drafts)[:m].tolist()))
            self.stats.add_speculative(rows=m, drafts=sum(plan.multi.steps) - m, accepted=int(ran.sum()) - m)
        self.stats.add_phases(layout=t1 - t0, device=time.perf_counter() - t1,
                              model_steps=1 if plan.speculative else int(ran.max(initial=0)))
        return result

    def _token_bitmask(self, plan: StepPlan) -> np.ndarray | None:
        """The token bitmask of the step's drawing rows (row j: the j-th token drawn, _drawing's order): a grammar's
        mask for structured rows, one allowed token for rows whose thinking budget forces `</think>`; None when no
        row is constrained now."""
        sampling = [it for _, it in _drawing(plan)]
        rows = [(j, it.seq.structured) for j, it in enumerate(sampling)
                if it.seq.structured is not None and it.seq.structured.needs_mask]
        forced = [(j, it.seq.thinking.forced_token) for j, it in enumerate(sampling)
                  if it.seq.thinking is not None and it.seq.thinking.forced_token is not None]
        if not rows and not forced:
            return None
        t0 = time.perf_counter()
        num_rows = _num_sampler_rows(plan, len(sampling))
        if rows:
            bitmask = fill_bitmask(rows, num_rows, self.cfg.vocab_size, self.cfg.eos_token_ids)
        else:
            bitmask = np.full((num_rows, bitmask_words(self.cfg.vocab_size)), -1, np.int32)
        force_rows(bitmask, forced)
        self.stats.structured_mask_seconds += time.perf_counter() - t0
        self.stats.num_structured_masks += len(rows)
        return bitmask

    def _window_bitmask(self, plan: StepPlan, window: WindowInputs, inputs) -> np.ndarray | None:
        """[D, W, ceil(V / 32)] grammar masks of a verify window (W: the layout's), each structured row's position j
        masked by its grammar after its drafts before j (matcher.fill_window_bitmask); None when no row is
        constrained."""
        rows = [(i, it.seq.structured, window.drafts[i, :window.steps[i] - 1].tolist())
                for i, it in enumerate(plan.items) if it.seq.structured is not None and it.seq.structured.needs_mask]
        if not rows:
            return None
        t0 = time.perf_counter()
        d, width = inputs.prefill.token_index.shape
        bitmask = fill_window_bitmask(rows, d, width, self.cfg.vocab_size, self.cfg.eos_token_ids)
        self.stats.structured_mask_seconds += time.perf_counter() - t0
        self.stats.num_structured_masks += len(rows)
        return bitmask

    def _sample(self, plan: StepPlan, logits, greedy, bitmask: np.ndarray | None = None) -> dict[str, SampledToken]:
        sampling = _drawing(plan)
        if not sampling:
            return {}
        rows = _sampling_rows([it for _, it in sampling])
        if bitmask is None and self.sampler_inputs.plain_greedy(rows):
            tokens = np.asarray(greedy).tolist()     # (jax.device_get costs ~40 us more a step)
            # logprob 0 and rank 1, as the sampler reports without logprobs
            return {it.seq.request_id: SampledToken(tokens[i], 0.0, 1, None, None) for i, it in sampling}
        num_rows = _num_sampler_rows(plan, len(sampling))
        index = np.zeros(num_rows, np.int32)
        index[:len(sampling)] = [i for i, _ in sampling]
        tensors, num_logprobs = self.sampler_inputs.build(rows, num_rows)
        tensors = tensors._replace(token_bitmask=bitmask)
        result = jax.device_get(_sample_rows(logits, index, tensors, num_logprobs=num_logprobs))
        return {it.seq.request_id: SampledToken.from_output(result, j) for j, (_, it) in enumerate(sampling)}

    def _step_params(self):
        """The weights the step runs: with LoRA, the adaptable leaves wrapped with the adapter stacks."""
        return self.params if self.lora is None else self.lora.attach(self.params)

    def free(self, request_id: str) -> None:
        self.sampler_inputs.free(request_id)
        if self.drafter is not None:
            self.drafter.free(request_id)

    def activation_bytes(self) -> int:
        """Device bytes the largest step shape needs beyond its arguments (XLA's memory analysis of the compiled
        step), for sizing the cache from gpu_memory_utilization. The step is compiled with small cache buffers and
        again with bigger ones: what it allocates should not grow with the cache (every cache buffer is updated in
        place). If it does (a copy of a cache buffer, e.g. a scatter XLA cannot run in place: a bug), the growth is
        logged as an error and budgeted: the bytes returned are the temporaries of the cache that then fits, so the
        first step does not run out of memory. Compiles that one shape twice."""
        from cache.device_buffers import allocate_cache_buffers
        from qnext.engine.cache_setup import device_memory_stats
        from qnext.model.cache_layout import cache_layout

        bucket = max(self.buckets.all, key=lambda b: b.sizes.num_tokens)
        s = bucket.sizes
        segments = [Segment([0] * 2, 0, [0], -1, 0)] if s.num_chunks else [Segment([0], 0, [0], -1, 0)] * 2
        inputs = build_step_inputs(segments, s, block_size=self.config.block_size, chunk=bucket.chunk,
                                   with_lora=self.lora is not None)
        layout = cache_layout(sharded_model_config(self.cfg, self.config.tensor_parallel_size),
                              self.params["embed"].dtype, 0, self.config.kv_cache_dtype,
                              self.config.mamba_ssm_cache_dtype)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)
        narrow = layout.narrow_snapshots and layout.num_state_layers and self.config.enable_prefix_caching

        def temp_and_cache_bytes(num_blocks, num_rows):
            rows = (dict(num_state_rows=num_rows + 1, num_pool_rows=num_rows, num_staging_rows=1) if narrow
                    else dict(num_state_rows=num_rows))                 # narrow: the pool grows too
            buffers = jax.eval_shape(lambda: allocate_cache_buffers(
                layout, num_blocks=num_blocks, block_size=self.config.block_size, **rows))
            analysis = self._step.lower(params, buffers, inputs).compile().memory_analysis()
            temp = int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0
            return temp, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(buffers))

        temp, cache = temp_and_cache_bytes(2, 2)
        big_temp, big_cache = temp_and_cache_bytes(2 + _PROBE_BLOCKS, 2 + _PROBE_ROWS)
        growth = (big_temp - temp) / (big_cache - cache)          # temporary bytes per cache byte
        if big_temp - temp <= max(_PROBE_NOISE_BYTES, 0.02 * (big_cache - cache)):
            return temp
        stats = device_memory_stats() or {}
        free = self.config.gpu_memory_utilization * stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0) - temp
        extra = int(max(0.0, free) * growth / (1 + growth))       # temporaries of the cache that then fits
        logger.error("the step's temporaries grow with the cache (%d -> %d bytes when the cache grows by %d bytes): "
                     "it copies a cache buffer instead of updating it in place, a bug. Budgeting %d more bytes of "
                     "activations, so the cache is about %.0f%% of what it could be", temp, big_temp,
                     big_cache - cache, extra, 100 / (1 + growth))
        return temp + extra

    def _warm_up_window(self, runs, bucket, buffers: CacheBuffers) -> CacheBuffers:
        """Compiles a window step (`runs`: the drafter's or multi-step's) over a decode bucket's rows, greedy and
        sampled, on padding rows that run nothing and write nothing but the dummy block."""
        d = bucket.sizes.num_decode
        window = WindowInputs.padding(d, runs.width)
        inputs = runs.layout([], bucket, window)
        sampled, _ = self.sampler_inputs.build([SamplingRow("warm-up", _WARM_UP_SAMPLING[1], [0], [], 0)], d)
        self.sampler_inputs.free("warm-up")
        variants = [inputs]
        if self.visual_encoder is not None and runs is self._multi:       # rows with pictures: MRoPE positions
            t = inputs.token_ids.shape[0]
            variants.append(inputs.replace(rope_positions=np.broadcast_to(
                np.asarray(inputs.positions, np.int32), (3, t)).copy()))
        for variant in variants:
            for sampling in (None, sampled):
                buffers = runs.run(self.params, buffers, variant, window, sampling, None)[2]
        return buffers

    @property
    def num_step_shapes(self) -> int:
        """The step shapes warm-up compiles: one per bucket, and with a tower one more per bucket (pictures)."""
        return len(self.buckets.all) * (1 if self.visual_encoder is None else 2)

    def warm_up(self, buffers: CacheBuffers, on_bucket=None) -> CacheBuffers:
        """Compiles the step for every bucket (and the common sampler variants) on idle inputs that write nothing
        but the dummy block and row; returns the buffers. `on_bucket()` is called after each bucket. The sampler
        compiles per logits-row count, so it runs once per count (at a 248k vocabulary each run of its sort costs
        more than its compile)."""
        sampler_rows = set()
        for bucket in self.buckets.all:
            s = bucket.sizes
            decode = min(s.num_decode, s.num_logits - (1 if s.num_chunks else 0), s.num_tokens - 2)
            segments = [Segment([0], 0, [0], -1, 0) for _ in range(decode)]
            if s.num_chunks:
                segments.append(Segment([0] * 2, 0, [0], -1, 0))
            inputs = build_step_inputs(segments, s, block_size=self.config.block_size, chunk=bucket.chunk,
                                       with_lora=self.lora is not None)
            # with a tower, a step with pictures has one more shape per bucket (visual_encoder.py): both compile here
            variants = [inputs] if self.visual_encoder is None else [inputs, self.visual_encoder.placeholder(inputs)]
            for variant in variants:
                if self._hidden:
                    logits, _, hidden, buffers = self._step(self._step_params(), buffers, variant)
                    buffers = self.drafter.warm_up(self.params, bucket, variant, hidden, buffers)
                else:
                    logits, _, buffers = self._step(self._step_params(), buffers, variant)
                if variant is not inputs and on_bucket is not None:
                    on_bucket()
            if self.context_parallel is not None:                 # and the split prefill step
                buffers = self.context_parallel.warm_up(self.params, buffers, bucket)
            # decode buckets also run windows; grammar fast-forward's alone compile on first use, as the grammar's
            # sampler variants do (most engines never verify a forced token)
            windows = [self.drafter] if self.drafter is not None and self.config.num_speculative_tokens else []
            for runs in windows + ([self._multi] if self._multi is not None else []):
                if bucket.is_decode:
                    buffers = self._warm_up_window(runs, bucket, buffers)
            for params in _WARM_UP_SAMPLING if s.num_logits not in sampler_rows else ():   # most requests' variants
                tensors, k = self.sampler_inputs.build([SamplingRow("warm-up", params, [0], [], 0)], s.num_logits)
                jax.block_until_ready(_sample_rows(logits, np.zeros(s.num_logits, np.int32), tensors, num_logprobs=k))
                self.sampler_inputs.free("warm-up")
            sampler_rows.add(s.num_logits)
            if on_bucket is not None:
                on_bucket()
        return buffers
