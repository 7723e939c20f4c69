"""LLMEngine: requests in, one continuous-batching step at a time, RequestOutputs out.

One step flows one way (docs/engine.md): the scheduler plans it (StepPlan, with the cache's buffers lent), the
runner lays it out, runs the jitted step and samples (StepResult, with the new buffers), and the scheduler's
postprocess commits, appends, checks stops, finishes and gives the buffers back to the cache manager.

With `prefix_cache_dir`, `close()` (or leaving a `with LLMEngine(...)` block) writes the prefix cache to disk and
a new engine on the same directory and the same model loads it at start (docs/cache.md).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cache.device_buffers import warm_up_fork_copies
from cache.fingerprint import files_digest_memoized
from cache.persisted_cache import save_prefix_cache
from qnext.config import ModelConfig
from qnext.engine.cache_setup import cache_sizes, make_cache, params_weights_digest, prefix_cache_fingerprint
from qnext.engine.compilation_cache import enable_compilation_cache
from qnext.engine.config import EngineConfig
from qnext.engine.drafter import Drafter
from qnext.engine.postprocess import request_output
from qnext.engine.runner import ModelRunner
from qnext.engine.scheduler import Scheduler
from qnext.engine.sequence import Sequence
from qnext.engine.stats import EngineStats
from qnext.engine.visual_encoder import VisionSetup, VisualEncoder
from qnext.engine.visual_intake import load_vision_setup, visual_prompt
from qnext.model.buckets import BucketTable
from qnext.model.checkpoint import load_checkpoint
from qnext.model.loader import checkpoint_files
from qnext.model.mtp import MTP_FILE
from qnext.model.placement import WeightUpdate, place_mtp_params, place_params
from qnext.model.tensor_parallel import make_mesh, parallel_config
from qnext.outputs import RequestOutput
from qnext.sampling_params import SamplingParams
from qnext.structured import GrammarCompiler, StructuredState
from qnext.structured import validate as validate_structured
from qnext.structured.thinking_budget import THINK_END, THINK_START, ThinkingBudget, prompt_inside_reasoning
from qnext.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("qnext.engine")

Prompt = str | dict | list
WEIGHTS_DIGEST_MEMO = "weights_digest.json"   # in prefix_cache_dir: the checkpoint's digest, by file sizes and times


class LLMEngine:
    _weights_digest: str | None = None   # of the weights the cache was computed with (only with prefix_cache_dir)
    compilation_cache_dir: str | None = None   # JAX's persistent compilation cache this engine turned on (None: off)
    _closed = False

    def __init__(self, model: str | Path, *, progress: Callable[[str], Any] | None = None, **options):
        model = Path(model)
        drafter = options.pop("drafter", Drafter)
        config = EngineConfig(**options)
        self.compilation_cache_dir = enable_compilation_cache(config.compilation_cache_dir)   # before any compile
        tokenizer = Tokenizer.from_pretrained(model) if (model / "tokenizer.json").is_file() else None
        (progress or (lambda msg: None))("loading weights")
        checkpoint = load_checkpoint(model, config.dtype, tensor_parallel_size=config.tensor_parallel_size,
                                     expert_parallel=config.enable_expert_parallel,
                                     attention_tensor_parallel=config.attention_tensor_parallel,
                                     with_mtp=bool(config.num_speculative_tokens))
        if config.num_speculative_tokens and checkpoint.mtp is None:
            raise ValueError(f"speculative_config {config.speculative_config} drafts with the checkpoint's MTP "
                             f"head, but {model} has none (no mtp.* tensors, no {MTP_FILE}); train one with "
                             "scripts/train_mtp.py or drop speculative_config")
        if config.prefix_cache_dir is not None and config.enable_prefix_caching:
            self._weights_digest = files_digest_memoized(checkpoint_files(model),
                                                         Path(config.prefix_cache_dir) / WEIGHTS_DIGEST_MEMO)
        self._start(config, checkpoint.config, checkpoint.params, tokenizer, checkpoint.mtp, drafter,
                    load_vision_setup(model, config.dtype))

    @classmethod
    def from_params(cls, cfg: ModelConfig, params, tokenizer: Tokenizer | None = None, **options) -> "LLMEngine":
        """An engine on in-memory weights (the params pytree of weights.param_specs(cfg), e.g. a Flax module's
        state): they are copied into the engine's own device buffers (cast to `dtype`, sharded under tensor
        parallelism), which `update_weights` later overwrites in place."""
        engine = cls.__new__(cls)
        mtp = options.pop("mtp_params", None)
        drafter = options.pop("drafter", Drafter)
        config = EngineConfig(**options)
        engine.compilation_cache_dir = enable_compilation_cache(config.compilation_cache_dir)  # before any compile
        if config.num_speculative_tokens and mtp is None:
            raise ValueError("speculative_config needs the MTP head's params: pass mtp_params= (qnext/model/mtp.py)")
        cfg = parallel_config(cfg, config.tensor_parallel_size, config.enable_expert_parallel,
                              config.attention_tensor_parallel)
        placed = place_params(params, cfg, config.dtype, config.tensor_parallel_size)
        engine._start(config, cfg, placed, tokenizer, None if mtp is None else place_mtp_params(mtp, config.dtype),
                      drafter)
        # updates arrive as the source's arrays (or, under tensor parallelism, re-placed like the engine's own)
        engine._weight_update.prepare(placed, params if config.tensor_parallel_size == 1 else None)
        return engine

    def update_weights(self, params) -> None:
        """Copies new weights (same structure and shapes; any float dtype, cast) into the engine's weight buffers
        in place (donated; nothing compiles) and drops the whole prefix cache, KV blocks and snapshots alike: both
        were computed with the old weights. Requests must not be in flight."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"update_weights with {self.num_running} running and {self.num_waiting} waiting "
                               "requests: their KV and states come from the old weights; finish or abort them first")
        self.runner.params = self._weight_update(self.runner.params, params)
        self.scheduler.clear_prefix_cache()
        self._weights_digest = None          # a persisted cache is bound to the new weights (digest at close)

    def _start(self, config: EngineConfig, cfg: ModelConfig, params, tokenizer: Tokenizer | None, mtp=None,
               drafter=Drafter, vision: VisionSetup | None = None) -> None:
        """mtp: the MTP head's params when the engine speculates; drafter(cfg, mtp, config) makes the runner's
        Drafter (engine option `drafter`: a subclass drafts otherwise, e.g. qnext/bench/oracle_drafts.py)."""
        cfg = cfg.with_backend()             # kernels and layouts chosen once, for every layer and step
        if cfg.backend == "gpu":             # Pallas Mosaic GPU or Triton, logged (pallas_kernels/backend_choice.py)
            from pallas_kernels.backend_choice import resolve_gpu_kernel_backend
            cfg = dataclasses.replace(cfg, gpu_kernels=resolve_gpu_kernel_backend(config.gpu_kernel_backend))
        self.config, self.model_config, self.tokenizer = config, cfg, tokenizer
        self._turn_start_id = None if tokenizer is None else tokenizer.token_to_id("<|im_start|>")
        self.max_model_len = config.resolved_max_model_len(cfg)
        mesh = make_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        buckets = BucketTable(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                              max_blocks=-(-self.max_model_len // config.block_size),
                              prefill_chunk=config.resolved_prefill_chunk(cfg.backend),
                              max_prefill_groups_extra=config.max_prefill_groups_extra)
        self.stats = EngineStats()
        self.vision = vision                 # the checkpoint's tower (None: text only; docs/vision.md)
        self.visual_encoder = VisualEncoder(vision, config.encoder_cache_bytes) if vision is not None else None
        self.runner = ModelRunner(cfg, params, config, buckets, self.stats,
                                  None if mtp is None else drafter(cfg, mtp, config), self.visual_encoder)
        self._weight_update = WeightUpdate(cfg, config.dtype, config.tensor_parallel_size)
        self.cache_sizes = cache_sizes(cfg, config, self.max_model_len, self.runner.activation_bytes)
        persisted = config.prefix_cache_dir is not None and config.enable_prefix_caching
        fingerprint = self._cache_fingerprint() if persisted else None
        cache, host_buffers = make_cache(cfg, config, self.cache_sizes, mesh, fingerprint)
        self.scheduler = Scheduler(config, cache, buckets, eos_token_ids=cfg.eos_token_ids,
                                   vocab_size=cfg.vocab_size, max_model_len=self.max_model_len,
                                   host_buffers=host_buffers)
        self.requests: dict[str, Sequence] = {}
        self._request_counter = 0
        self._grammar_compiler = None if tokenizer is None else _background(
            GrammarCompiler.for_tokenizer, tokenizer, cfg.vocab_size, cfg.eos_token_ids or tokenizer.eos_token_ids)

    def warm_up(self, on_bucket=None) -> int:
        """Compiles every step shape (and the common sampler variants); after it a workload compiles nothing.
        Returns the number of shapes."""
        buffers = self.runner.warm_up(self.scheduler.lend_buffers(), on_bucket)
        buffers = warm_up_fork_copies(buffers, max(1, self.config.max_num_seqs - 1))     # n > 1 (cache/forks.py)
        if self.scheduler.host_buffers is not None:           # and the copies between the tiers
            buffers = self.scheduler.host_buffers.warm_up(buffers)
        self.scheduler.return_buffers(buffers)
        return self.num_step_shapes

    @property
    def num_step_shapes(self) -> int:
        return len(self.runner.buckets.all)

    # ---- requests --------------------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json; pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a prompt dict needs the key 'prompt_token_ids'")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(token_ids, params, self.model_config.vocab_size, self.max_model_len)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} samples run together, but max_num_seqs is {self.config.max_num_seqs}; "
                             "ask for fewer or raise max_num_seqs")
        self.validate_structured_outputs(params)

    def validate_structured_outputs(self, params: SamplingParams) -> None:
        """Compiles the request's structured_outputs (cached per spec): ValueError naming the problem when its
        schema, regex or grammar is invalid. Any thread may call it."""
        if params.structured_outputs is not None:
            validate_structured(params, self.grammar_compiler())

    def grammar_compiler(self) -> GrammarCompiler | None:
        """The engine's structured-output compiler (None without a tokenizer); its build starts in the background
        when the engine starts (seconds at a 248k vocabulary), so the first constrained request waits at most for
        the rest of it."""
        return self._grammar_compiler.result() if self._grammar_compiler is not None else None

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed; start a new one (with the same prefix_cache_dir to reuse its "
                               "cache)")
        params = params or SamplingParams()
        visuals = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            text, token_ids, visuals = visual_prompt(prompt, self.tokenizer, self.vision)
        else:
            text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = [int(t) for t in token_ids]
        samples = [self._sample_sequence(request_id, token_ids, text, params, i) for i in range(params.n)]
        for sample in samples:
            sample.visuals = visuals
        seq = samples[0]
        if params.n > 1:          # one admission and prefill; the others are forked after it (docs/engine.md)
            for sample in samples:
                sample.group = samples
            seq.pending_forks = samples[1:]
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(token_ids)

    def _thinking_budget(self, token_ids: list[int], params: SamplingParams) -> ThinkingBudget | None:
        if params.thinking_token_budget is None:
            return None
        ids = [self.tokenizer.token_to_id(t) if self.tokenizer is not None else None
               for t in (THINK_START, THINK_END)]
        if None in ids:
            raise ValueError(f"thinking_token_budget needs the tokens {THINK_START} and {THINK_END}, which this "
                             "checkpoint's tokenizer does not have")
        start_id, end_id = ids
        return ThinkingBudget(params.thinking_token_budget, [end_id],
                              prompt_inside_reasoning(token_ids, start_id, end_id))

    def _sample_sequence(self, request_id: str, token_ids: list[int], text, params: SamplingParams,
                         index: int) -> Sequence:
        """Sample `index` of a request: its own id inside the engine, and its own seed stream (seed + index, as
        vLLM; unseeded, its own arrival index)."""
        if params.n > 1:
            seed = None if params.seed is None else params.seed + index
            params = dataclasses.replace(params, n=1, seed=seed)
        structured = None             # each sample its own matcher and budget
        if params.structured_outputs is not None:
            compiler = self.grammar_compiler()
            matcher = validate_structured(params, compiler)
            structured = StructuredState(matcher, params.structured_outputs.start_after,
                                         grammar_eos_ids=compiler.special_eos_token_ids)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params) if self.tokenizer is not None else None
        seq = Sequence(request_id if index == 0 else f"{request_id}#{index}", token_ids, params,
                       self._request_counter, prompt=text, detokenizer=detokenizer, index=index,
                       structured=structured, thinking=self._thinking_budget(token_ids, params),
                       turn_starts=self._turn_starts(token_ids))
        self._request_counter += 1
        return seq

    def _turn_starts(self, token_ids: list[int]) -> tuple[int, ...]:
        """Where the prompt's last two chat turns start (the cache captures state snapshots there); the scan stops
        at the second `<|im_start|>` from the end."""
        if self._turn_start_id is None:
            return ()
        starts = []
        for i in range(len(token_ids) - 1, -1, -1):
            if token_ids[i] == self._turn_start_id:
                starts.append(i)
                if len(starts) == 2:
                    break
        return tuple(reversed(starts))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Aborts every unfinished sample of the request; None if it is unknown or finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        samples = seq.group or [seq]
        if all(s.is_finished for s in samples):
            return None
        seq.pending_forks = []                  # samples not forked yet are finished below, never admitted
        for sample in samples:
            if not sample.is_finished:
                self.scheduler.abort(sample)
                self.runner.free(sample.request_id)
        return request_output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def cache_info(self) -> dict:
        """The cache's split: num_blocks, block_size, kv_bytes, num_live_rows, num_snapshot_rows, state_bytes
        (live + snapshot rows, the zero row included) and budget_bytes (per device)."""
        return self.cache_sizes.as_dict()

    @property
    def cache_stats(self):
        """The prefix cache's counters (cache.CacheStats): tokens reused / lost to a missing state, snapshots."""
        return self.scheduler.cache_stats

    # ---- shutting down ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Writes the prefix cache (its index and both tiers' contents) to `prefix_cache_dir` if one is set; then
        the engine takes no new requests. Requests still in flight are not finished (the blocks they published are
        written). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.config.prefix_cache_dir is None or not self.config.enable_prefix_caching:
            return
        if self.scheduler.cache.buffers is None:
            logger.warning("the prefix cache is not written to %s: a step failed before it returned the cache's "
                           "buffers", self.config.prefix_cache_dir)
            return
        self.scheduler.flush_transfers()
        path = save_prefix_cache(self.config.prefix_cache_dir, self.scheduler.cache, self.scheduler.host_buffers,
                                 self._cache_fingerprint())
        logger.info("prefix cache written to %s (%d bytes)", path, path.stat().st_size)

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cache_fingerprint(self) -> dict:
        if self._weights_digest is None:
            self._weights_digest = params_weights_digest(self.runner.params)
        return prefix_cache_fingerprint(self.model_config, self.config, self._weights_digest)

    def cache_usage(self) -> dict:
        """Pool occupancy now (Scheduler.cache_usage): KV blocks, live state rows, snapshot rows."""
        return self.scheduler.cache_usage()

    def running_request_ids(self) -> list[str]:
        """The requests with a running sample (a request's n samples once)."""
        return list(dict.fromkeys(seq.first.request_id for seq in self.scheduler.running))

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that produced a token or finished."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                raise RuntimeError(f"request {seq.request_id} ({seq.num_tokens} tokens) cannot be scheduled: "
                                   "the KV cache or state slots are too small")
            return []
        t1 = time.perf_counter()
        result = self.runner.execute(plan)
        t2 = time.perf_counter()
        updated, generated = self.scheduler.postprocess(plan, result)
        for seq in updated:
            if seq.is_finished:
                self.runner.free(seq.request_id)
        outputs = [request_output(seq) for seq in dict.fromkeys(seq.first for seq in updated)]
        t3 = time.perf_counter()
        s = self.stats
        s.num_steps += 1
        s.num_scheduled_sequences += len(plan.items)
        s.num_scheduled_tokens += sum(len(it.segment.token_ids) for it in plan.items)
        s.num_prefill_tokens += sum(max(0, min(it.end, len(it.seq.prompt_token_ids)) - it.start) for it in plan.items)
        s.num_generated_tokens += generated
        s.schedule_seconds += t1 - t0
        s.postprocess_seconds += t3 - t2
        s.step_seconds += t3 - t0
        return outputs

    def stream_text(self, request_id: str, index: int = 0) -> str:
        """Text generated since the last call for this request's sample `index` (for streaming)."""
        seq = self.requests[request_id]
        seq = seq.group[index] if seq.group else seq
        return seq.detokenizer.get_next_output_text(seq.is_finished, delta=True) if seq.detokenizer else ""

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (the LLM front end calls it after returning the output)."""
        self.requests.pop(request_id, None)


def _background(fn, *args) -> concurrent.futures.Future:
    """fn(*args) on a daemon thread (holding no reference to the engine, which may be freed meanwhile)."""
    future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:        # re-raised by future.result() in the caller
            future.set_exception(e)
    threading.Thread(target=run, name="qnext-grammar-tokenizer", daemon=True).start()
    return future


def validate_prompt(token_ids, params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """What every request must satisfy, as a ValueError that says what was wrong (pure: any thread may call it)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty")
    if not all(isinstance(t, (int, np.integer)) for t in token_ids):
        raise ValueError("prompt_token_ids must be integers")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {max_model_len} "
                         "(the prompt must leave room for at least one generated token)")


def freeze_startup_heap() -> None:
    """Makes every object alive now permanent for Python's cyclic GC, as vLLM does after start-up: otherwise each
    oldest-generation collection walks the whole start-up heap (JAX, the tokenizer, the engine), which cost ~2 ms a
    step at 64 rows of the tiny model (docs/engine.md). Optional, for long-running front ends and benchmarks; a
    library constructor does not call it."""
    gc.collect()
    gc.freeze()
