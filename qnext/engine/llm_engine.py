"""LLMEngine: requests in, one continuous-batching step at a time, RequestOutputs out."""
from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cache import CacheConfig, CacheManager, snapshot_pool_capacity
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.runner import ModelRunner, SampledToken
from qnext.engine.sampler import check_stop
from qnext.engine.scheduler import Scheduler
from qnext.engine.sequence import Sequence, SequenceStatus
from cache.device_buffers import allocate_cache_buffers, num_state_rows
from qnext.model.cache_buffers import cache_layout
from qnext.model.loader import convert_checkpoint, load_params
from qnext.model.tensor_parallel import local_config, make_mesh, shard_params, sharded_buffers
from qnext.model.weights import as_dtype
from qnext.outputs import CompletionOutput, RequestMetrics, RequestOutput, logprobs_entry
from qnext.sampling_params import SamplingParams
from qnext.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("qnext.engine")

Prompt = str | dict | list


@dataclasses.dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    step_seconds: float = 0.0        # wall time of engine.step(), host work included
    device_seconds: float = 0.0      # time in the jitted step + sampler

    @property
    def host_overhead(self) -> float:
        return 0.0 if self.step_seconds == 0 else 1.0 - self.device_seconds / self.step_seconds


class LLMEngine:
    def __init__(self, model: str | Path, *, progress: Callable[[str], Any] | None = None, **options):
        model = Path(model)
        if not (model / "config.json").is_file():
            raise ValueError(f"{model} is not a checkpoint directory: config.json is missing")
        self.config = EngineConfig(**options)
        self.model_config = cfg = ModelConfig.from_pretrained(model)
        self.max_model_len = self.config.resolved_max_model_len(cfg)
        self.tokenizer = Tokenizer.from_pretrained(model) if (model / "tokenizer.json").is_file() else None
        say = progress or (lambda msg: None)
        say("loading weights")
        dtype = as_dtype(self.config.dtype)
        tp = self.config.tensor_parallel_size
        if tp > 1:                       # host arrays, then each device gets only its shard
            local_config(cfg, tp)        # the heads must divide: checked before anything is read
            mesh = make_mesh(tp)
            params = shard_params(convert_checkpoint(model, cfg, dtype), cfg, mesh)
        else:
            params = load_params(model, cfg, dtype)

        c = self.config
        blocks_per_seq = -(-self.max_model_len // c.block_size)
        num_blocks = (c.num_gpu_blocks_override if c.num_gpu_blocks_override is not None
                      else c.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(f"num_gpu_blocks_override={num_blocks} blocks of {c.block_size} tokens cannot hold one "
                             f"sequence of max_model_len {self.max_model_len}")
        hybrid = bool(cfg.linear_layer_ids)
        layout = cache_layout(cfg, dtype)
        # Snapshot rows; an explicit max_num_snapshots is honoured even with caching off, so that engines that
        # differ only in enable_prefix_caching share buffer shapes (and compilations).
        default = 4 * c.max_num_seqs if c.enable_prefix_caching else 0
        requested = (c.max_num_snapshots if c.max_num_snapshots is not None else default) if hybrid else 0
        num_snapshots = requested
        if c.snapshot_memory_bytes is not None and requested:
            num_snapshots = snapshot_pool_capacity(requested, layout.state_bytes_per_row, c.snapshot_memory_bytes)
        self.cache = CacheManager(CacheConfig(block_size=c.block_size, num_blocks=num_blocks + 1,
                                              num_live_slots=c.max_num_seqs, num_snapshot_slots=num_snapshots,
                                              enable_prefix_caching=c.enable_prefix_caching, hybrid=hybrid))
        allocate = functools.partial(allocate_cache_buffers, layout, num_blocks=num_blocks + 1, block_size=c.block_size,
                                     num_state_rows=num_state_rows(c.max_num_seqs, num_snapshots))
        buffers = sharded_buffers(allocate, mesh) if tp > 1 else allocate()
        self.runner = ModelRunner(cfg, params, buffers, c, self.max_model_len, self.cache)
        self.scheduler = Scheduler(c, self.cache, self.runner.new_layout)
        self.requests: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._request_counter = 0
        self.stats = EngineStats()
        # The start-up heap (JAX, the tokenizer, this engine) becomes permanent for the cyclic GC, as vLLM does
        # after start-up: otherwise each oldest-generation collection walks all of it, which cost ~2 ms a step at
        # 64 rows of the tiny model (a cache commit, where the collections happened to fall: 40 -> 5 us a row).
        # Objects alive now are no longer collected as cyclic garbage; an engine holds no reference cycles and is
        # freed by reference counting when dropped (tested).
        gc.collect()
        gc.freeze()

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
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, (int, np.integer)) for t in token_ids):
            raise ValueError("prompt_token_ids must be integers")
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             "(the prompt must leave room for at least one generated token)")

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, [int(t) for t in token_ids], params, self._request_counter, prompt=text)
        self._request_counter += 1
        self.requests[request_id] = seq
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params)
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.abort(seq)
        self._finish(seq, "abort", None, release_cache=False)
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def cache_stats(self):
        """The prefix cache's counters (cache.CacheStats): tokens reused / lost to a missing state, snapshots."""
        return self.cache.stats

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that produced a token or finished."""
        t0 = time.perf_counter()
        items = self.scheduler.schedule()
        if not items:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                raise RuntimeError(f"request {seq.request_id} ({seq.num_tokens} tokens) cannot be scheduled: "
                                   "the KV cache or state slots are too small")
            return []
        device_before = self.runner.step_time
        outputs = self._multi_step(items) if self.runner.multi_step_ok(items) else self._single_step(items)
        self.stats.num_steps += 1
        self.stats.device_seconds += self.runner.step_time - device_before
        self.stats.step_seconds += time.perf_counter() - t0
        return outputs

    def _single_step(self, items) -> list[RequestOutput]:
        sampled = self.runner.execute(items)
        outputs = []
        for it in items:
            seq = it.seq
            seq.num_computed_tokens = it.end
            seq.read_row = seq.state_row
            self.cache.commit(seq.request_id, seq.token_view, seq.num_computed_tokens)
            token = sampled.get(seq.request_id)
            if token is not None:
                self._append(seq, token)
                outputs.append(self._output(seq))
        return outputs

    def _multi_step(self, items) -> list[RequestOutput]:
        """Several decode steps in one call (num_scheduler_steps; see multi_step.py). Each row runs at most
        what its max_tokens and max_model_len leave and what its KV blocks hold (extended here when the cache has
        blocks free, never by preempting); the device stops a row after an EOS / stop token id as check_stop
        does (rows still short of min_tokens with such ids do not come here: their ids are suppressed), and the
        host replays every token through the same bookkeeping as single steps."""
        k_max, bs, cache = self.config.num_scheduler_steps, self.config.block_size, self.cache
        eos = list(self.model_config.eos_token_ids)
        steps, captures, stop_ids = [], [], []
        for it in items:
            seq, p = it.seq, it.seq.params
            rid, start = seq.request_id, it.start
            n = min(k_max, self.max_model_len - seq.num_tokens)
            if p.max_tokens is not None:
                n = min(n, p.max_tokens - len(seq.output_token_ids))
            if not cache.append_slots(rid, start + n):           # blocks for the extra tokens, if free
                n = max(1, min(n, len(cache.block_table(rid)) * bs - start))
            ends = [e for e in range(start + 1, start + n + 1) if e % bs == 0]   # block boundaries computed
            row = cache.decode_tracking_row(rid) if ends and cache.uses_snapshots else None
            steps.append(n)
            captures.append({e - start - 1: row for e in ends} if row is not None else {})    # step -> row
            stop_ids.append(([] if p.ignore_eos else eos) + list(p.stop_token_ids))
        tokens, ran = self.runner.execute_multi(items, steps, captures, stop_ids)
        outputs = []
        for i, it in enumerate(items):
            seq, start = it.seq, it.start
            reached = [step for step in captures[i] if step < ran[i]]
            if reached:                          # the tracking row now holds the state after this many tokens
                self.cache.decode_capture_row(seq.request_id, start + max(reached) + 1)
            stop = self._append_tokens(seq, tokens[:ran[i], i].tolist())
            seq.num_computed_tokens = seq.num_tokens - 1     # all but the last token, sampled and not yet run
            seq.read_row = seq.state_row
            self.cache.commit(seq.request_id, seq.token_view, seq.num_computed_tokens)
            if stop is not None:
                self._finish(seq, *stop)
            outputs.append(self._output(seq))
        return outputs

    def _append(self, seq: Sequence, token: SampledToken) -> None:
        p = seq.params
        seq.cumulative_logprob += token.logprob
        if p.logprobs is not None:
            decode = self.tokenizer.decode_token if self.tokenizer else None
            seq.logprobs = seq.logprobs or []
            seq.logprobs.append(logprobs_entry(token.token_id, token.logprob, token.rank,
                                               token.top_ids if token.top_ids is not None else [],
                                               token.top_logprobs if token.top_logprobs is not None else [],
                                               p.logprobs, decode))
        stop = self._append_tokens(seq, [token.token_id])
        if stop is not None:
            self._finish(seq, *stop)

    def _append_tokens(self, seq: Sequence, token_ids: list[int]) -> tuple | None:
        """Appends tokens up to and including the first that stops the request (check_stop, token by token),
        detokenises them at once (stop strings included) and returns the stop, or None. One sampled token, or a
        multi-step call's tokens for one row (which has no stop strings)."""
        out, p, stop = seq.output_token_ids, seq.params, None
        kept = 0
        for token in token_ids:
            out.append(token)
            kept += 1
            stop = check_stop(p, out, self.model_config.eos_token_ids, seq.num_tokens, self.max_model_len)
            if stop is not None:
                break
        self.stats.num_generated_tokens += kept
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        detok = self._detokenizers.get(seq.request_id)
        if detok is not None:
            token_stop = stop is not None and stop[0] == "stop"
            stop_string = detok.update(out[len(out) - kept:], stop_token_terminated=token_stop)
            if stop_string is not None:
                stop = ("stop", stop_string)
        return stop

    def _finish(self, seq: Sequence, reason: str, stop_reason, release_cache: bool = True) -> None:
        if release_cache:
            self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.runner.free(seq.request_id)
        detok = self._detokenizers.get(seq.request_id)
        if detok is not None:
            detok.update([], finished=True)

    def _output(self, seq: Sequence) -> RequestOutput:
        detok = self._detokenizers.get(seq.request_id)
        text = detok.get_next_output_text(seq.is_finished, delta=False) if detok is not None else ""
        completion = CompletionOutput(index=0, text=text, token_ids=list(seq.output_token_ids),
                                      cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None
                                      else None, logprobs=seq.logprobs, finish_reason=seq.finish_reason,
                                      stop_reason=seq.stop_reason)
        metrics = RequestMetrics(arrival_time=seq.arrival_time, first_scheduled_time=seq.first_scheduled_time,
                                 first_token_time=seq.first_token_time,
                                 num_lost_to_missing_state_tokens=seq.num_lost_to_missing_state_tokens)
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                             outputs=[completion], finished=seq.is_finished,
                             num_cached_tokens=seq.num_cached_tokens or 0, metrics=metrics)

    def stream_text(self, request_id: str) -> str:
        """Text generated since the last call for this request (for streaming)."""
        detok = self._detokenizers.get(request_id)
        seq = self.requests[request_id]
        return detok.get_next_output_text(seq.is_finished, delta=True) if detok is not None else ""

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (the LLM front end calls it after returning the output)."""
        self.requests.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
