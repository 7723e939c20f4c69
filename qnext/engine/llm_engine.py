"""LLMEngine: requests in, one continuous-batching step at a time, RequestOutputs out.

Requests come in through engine/intake.py (a prompt and its params checked and turned into Sequences); the cache
(engine/engine_cache.py) is sized and built by engine/cache_setup.py; this file starts them and runs the loop.

One step flows one way (docs/engine.md): the scheduler plans it (StepPlan, with the cache's buffers lent), the
runner lays it out, runs the jitted step and samples (StepResult, with the new buffers), and the scheduler's
postprocess commits, appends, checks stops, finishes and gives the buffers back to the cache manager.

With `prefix_cache_dir`, `close()` (or leaving a `with LLMEngine(...)` block) writes the prefix cache to disk and
a new engine on the same directory and the same model loads it at start (docs/cache.md).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from cache.fork_buffer_copies import warm_up_fork_copies
from cache.snapshot_lifecycle import weak_method
from qnext.config import ModelConfig
from qnext.engine.cache_setup import cache_sizes, make_cache
from qnext.engine.compilation_cache import enable_compilation_cache
from qnext.engine.config import EngineConfig
from qnext.engine.drafter import Drafter
from qnext.engine.suffix_drafter import host_drafter
from qnext.engine.engine_cache import EngineCache
from qnext.engine.intake import Prompt, RequestIntake
from qnext.engine.model_source import load_model_source, running_config
from qnext.engine.pd_engine import PrefillDecodeEnds
from qnext.engine.postprocess import request_output
from qnext.engine.runner import ModelRunner
from qnext.engine.scheduler import Scheduler
from qnext.engine.sequence import Sequence
from qnext.engine.stats import EngineStats
from qnext.engine.visual_encoder import VisionSetup, VisualEncoder
from qnext.engine.weights_identity import WeightsIdentity
from qnext.lora.adapter_stacks import AdapterStacks
from qnext.lora.registry import AdapterRegistry, LoRARequest
from qnext.model.buckets import BucketTable
from qnext.model.placement import WeightUpdate, place_mtp_params, place_params
from qnext.model.tensor_parallel import make_mesh, parallel_config
from qnext.model.vision_weights import replaced_vision_params
from qnext.outputs import RequestOutput
from qnext.sampling_params import SamplingParams
from qnext.served_engine import EngineSnapshot, ServedEngine, ServedModel
from qnext.structured import GrammarCompiler
from qnext.tokenizer import Tokenizer


class LLMEngine(ServedEngine):
    compilation_cache_dir: str | None = None   # JAX's persistent compilation cache this engine turned on (None: off)
    _closed = False

    def __init__(self, model: str | Path, *, progress: Callable[[str], Any] | None = None, **options):
        model = Path(model)
        drafter = options.pop("drafter", Drafter)
        config = EngineConfig(**options)
        self.compilation_cache_dir = enable_compilation_cache(config.compilation_cache_dir)   # before any compile
        source = load_model_source(model, config, progress)
        self.weights_identity = source.identity
        self._start(config, source.cfg, source.params, source.tokenizer, source.mtp, drafter, source.vision)

    @classmethod
    def from_params(cls, cfg: ModelConfig, params, tokenizer: Tokenizer | None = None, **options) -> "LLMEngine":
        """An engine on in-memory weights (the params pytree of weights.param_specs(cfg), e.g. a Flax module's
        state): they are copied into the engine's own device buffers (cast to `dtype`, sharded under tensor
        parallelism), which `update_weights` later overwrites in place."""
        engine = cls.__new__(cls)
        engine.weights_identity = WeightsIdentity()
        mtp = options.pop("mtp_params", None)
        drafter = options.pop("drafter", Drafter)
        config = EngineConfig(**options)
        engine.compilation_cache_dir = enable_compilation_cache(config.compilation_cache_dir)  # before any compile
        if config.uses_mtp_head and mtp is None:
            raise ValueError("speculative_config needs the MTP head's params: pass mtp_params= (qnext/model/mtp.py)")
        cfg = parallel_config(cfg, config.tensor_parallel_size, config.enable_expert_parallel,
                              config.attention_tensor_parallel)
        placed = place_params(params, cfg, config.dtype, config.tensor_parallel_size)
        engine._start(config, cfg, placed, tokenizer, None if mtp is None else place_mtp_params(mtp, config.dtype),
                      drafter)
        # updates arrive as the source's arrays (or, under tensor parallelism, re-placed like the engine's own)
        engine._weight_update.prepare(placed, params if config.tensor_parallel_size == 1 else None)
        return engine

    def update_weights(self, params, vision_params=None) -> None:
        """Copies new weights (same structure and shapes; any float dtype, cast) into the engine's weight buffers
        in place (donated; nothing compiles) and drops the whole prefix cache, KV blocks and snapshots alike: both
        were computed with the old weights. vision_params: the tower's new weights (qnext/vision/tower.py's pytree,
        e.g. qnext.flax.vision_params(model)), None to keep its own; either way the tower's cached outputs are
        dropped. Requests must not be in flight."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"update_weights with {self.num_running} running and {self.num_waiting} waiting "
                               "requests: their KV and states come from the old weights; finish or abort them first")
        if vision_params is not None and self.vision is None:
            raise ValueError("update_weights got vision_params, but this engine has no vision tower (a text-only "
                             "checkpoint, or an engine from in-memory weights); drop vision_params")
        tower = None if vision_params is None else replaced_vision_params(self.vision.params, vision_params)
        self.runner.params = self._weight_update(self.runner.params, params)
        if tower is not None:
            self.vision = dataclasses.replace(self.vision, params=tower)
        if self.visual_encoder is not None:
            self.visual_encoder.use_weights(self.vision)
        self.cache.manager.clear_prefix_cache()
        self.weights_identity.weights_replaced()    # a persisted cache is bound to the new weights (digest at close)

    def _start(self, config: EngineConfig, cfg: ModelConfig, params, tokenizer: Tokenizer | None, mtp=None,
               drafter=Drafter, vision: VisionSetup | None = None) -> None:
        """mtp: the MTP head's params when the engine speculates; drafter(cfg, mtp, config) makes the runner's
        Drafter (engine option `drafter`: a subclass drafts otherwise, e.g. qnext/bench/oracle_drafts.py)."""
        cfg = running_config(cfg, config)
        self.config, self.model_config, self.tokenizer = config, cfg, tokenizer
        self.max_model_len = config.resolved_max_model_len(cfg)
        self.intake = RequestIntake(config, cfg, tokenizer, self.max_model_len,   # starts the grammar compiler
                                    vision)
        mesh = make_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        buckets = BucketTable(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                              max_blocks=-(-self.max_model_len // config.block_size),
                              prefill_chunk=config.resolved_prefill_chunk(cfg.backend),
                              max_prefill_groups_extra=config.max_prefill_groups_extra)
        self.stats = EngineStats()
        self.vision = vision                 # the checkpoint's tower (None: text only; docs/vision.md)
        self.visual_encoder = VisualEncoder(vision, config.encoder_cache_bytes, self.stats) if vision else None
        self.lora = AdapterRegistry(AdapterStacks(cfg, params["embed"].dtype, config.max_loras, config.max_lora_rank),
                                    config.max_cpu_loras) if config.enable_lora else None
        self.runner = ModelRunner(cfg, params, config, buckets, self.stats,
                                  host_drafter(cfg, config) or (None if mtp is None else drafter(cfg, mtp, config)),
                                  self.visual_encoder,
                                  self.lora.stacks if self.lora is not None else None)
        self._weight_update = WeightUpdate(cfg, config.dtype, config.tensor_parallel_size)
        self.cache_sizes = cache_sizes(cfg, config, self.max_model_len, self.runner.activation_bytes)
        persisted = config.prefix_cache_dir is not None and config.enable_prefix_caching
        fingerprint = self._cache_fingerprint() if persisted else None
        self.cache = EngineCache(*make_cache(cfg, config, self.cache_sizes, mesh, fingerprint))
        self.scheduler = Scheduler(config, self.cache, buckets, eos_token_ids=cfg.eos_token_ids,
                                   vocab_size=cfg.vocab_size, max_model_len=self.max_model_len)
        self.requests: dict[str, Sequence] = {}
        # the callbacks hold the engine weakly: no cycle, so a dropped engine frees its buffers by refcount
        self.pd = PrefillDecodeEnds(cfg, config.tensor_parallel_size, config.block_size, config.kv_cache_scale,
                                    self.max_model_len, intake=self.intake, cache=self.cache, stats=self.stats,
                                    eos_token_ids=cfg.eos_token_ids, admit=weak_method(self._admit),
                                    check_new=weak_method(self._check_new),
                                    model_identity=weak_method(self.model_identity))

    def warm_up(self, on_bucket=None) -> int:
        """Compiles every step shape (and the common sampler variants); after it a workload compiles nothing.
        Returns the number of shapes."""
        buffers = self.runner.warm_up(self.cache.lend_buffers(), on_bucket)
        buffers = warm_up_fork_copies(buffers, max(1, self.config.max_num_seqs - 1))     # n > 1 (cache/forks.py)
        if self.cache.host_buffers is not None:           # and the copies between the tiers
            buffers = self.cache.host_buffers.warm_up(buffers)
        self.cache.return_buffers(buffers)
        return self.num_step_shapes

    @property
    def num_step_shapes(self) -> int:
        return self.runner.num_step_shapes

    # ---- requests --------------------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.intake.tokenize(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.intake.validate(token_ids, params)

    def validate_structured_outputs(self, params: SamplingParams) -> None:
        """Compiles the request's structured_outputs (cached per spec): ValueError naming the problem when its
        schema, regex or grammar is invalid. Any thread may call it."""
        self.intake.validate_structured_outputs(params)

    def grammar_compiler(self) -> GrammarCompiler | None:
        """The engine's structured-output compiler (None without a tokenizer); its build starts in the background
        when the engine starts (seconds at a 248k vocabulary), so the first constrained request waits at most for
        the rest of it."""
        return self.intake.grammar_compiler()

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """lora_request: the adapter the request runs with (engine option enable_lora; docs/lora.md); a prompt dict
        may carry it as "lora_request" instead (the server's requests: it travels with the prompt)."""
        self._check_new(request_id)
        samples = self.intake.samples(request_id, prompt, params or SamplingParams())
        if lora_request is None and isinstance(prompt, dict):
            lora_request = prompt.get("lora_request")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"request {request_id!r} names LoRA adapter {lora_request.lora_name!r}, but the "
                                 "engine was started without enable_lora=True")
            use = self.lora.use(lora_request, len(samples))     # its device slot is bound at admission
            for sample in samples:
                sample.lora = use
        self._admit(samples[0])

    def _check_new(self, request_id: str) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed; start a new one (with the same prefix_cache_dir to reuse its "
                               "cache)")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _admit(self, seq: Sequence) -> None:
        """A request's sequence (sample 0), built by the intake, into the request table and the scheduler."""
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(seq.prompt_token_ids)

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
                self._free(sample)
        return request_output(seq)

    def _free(self, seq: Sequence) -> None:
        self.runner.free(seq.request_id)
        if seq.lora is not None:
            self.lora.release(seq.lora)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def cache_info(self) -> dict:
        """The cache's split: num_blocks, block_size, kv_bytes, num_live_rows, num_snapshot_rows, num_staging_rows
        (float32 rows of a narrow snapshot pool's step; 0 with float32 snapshots), state_bytes (live, staging and
        snapshot rows, the zero row included) and budget_bytes (per device)."""
        return self.cache_sizes.as_dict()

    @property
    def cache_stats(self):
        """The prefix cache's counters (cache.CacheStats): tokens reused / lost to a missing state, snapshots."""
        return self.cache.manager.stats

    # ---- shutting down ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Writes the prefix cache (its index and both tiers' contents) to `prefix_cache_dir` if one is set; then
        the engine takes no new requests. Requests still in flight are not finished (the blocks they published are
        written). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.config.prefix_cache_dir is not None and self.config.enable_prefix_caching:
            self.cache.save(self.config.prefix_cache_dir, self._cache_fingerprint())

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def model_identity(self) -> str:
        """What this engine computes with, as one digest (engine/weights_identity.py): every PD transfer and every
        rank's handshake carries it. Computed once (reading the weights)."""
        return self.weights_identity.model_identity(self.model_config, self.config, self.runner.params)

    def _cache_fingerprint(self) -> dict:
        return self.weights_identity.cache_fingerprint(self.model_config, self.config, self.runner.params)

    def cache_usage(self) -> dict:
        """Pool occupancy now (EngineCache.usage): KV blocks, live state rows, snapshot rows."""
        return self.cache.usage()

    @property
    def served_model(self) -> ServedModel:
        return ServedModel(self.tokenizer, self.max_model_len, self.model_config.vocab_size, self.config.block_size,
                           self.cache_sizes.num_blocks, self.vision, self.validate_structured_outputs)

    def status(self) -> EngineSnapshot:
        return EngineSnapshot(self.num_running, self.num_waiting, dataclasses.asdict(self.cache_stats),
                              dataclasses.asdict(self.stats), self.cache_usage())

    def take_failed_requests(self) -> list[tuple[str, Exception]]:
        """None here: a request fails alone only in a PD decode role (server/pd_role_engines.py)."""
        return []

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
        self.pd.export_prefilled()
        for seq in updated:
            if seq.is_finished:
                self._free(seq)
        outputs = [request_output(seq) for seq in dict.fromkeys(seq.first for seq in updated)]
        t3 = time.perf_counter()
        self.stats.record_step(plan.items, generated, t0, t1, t2, t3)
        return outputs

    def stream_text(self, request_id: str, index: int = 0) -> str:
        """Text generated since the last call for this request's sample `index` (for streaming)."""
        seq = self.requests[request_id]
        seq = seq.group[index] if seq.group else seq
        return seq.detokenizer.get_next_output_text(seq.is_finished, delta=True) if seq.detokenizer else ""

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (the LLM front end calls it after returning the output)."""
        self.requests.pop(request_id, None)
