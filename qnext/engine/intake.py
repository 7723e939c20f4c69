"""Request intake: a prompt and its SamplingParams checked and turned into the Sequences the scheduler runs.

Everything here is host work on one request (tokenizing, validation, compiling its structured outputs, the
thinking budget, where its chat turns start); nothing touches the cache or the device. `validate_prompt` is pure,
so the server's admission runs it on its own threads.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import numpy as np

from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.sequence import Sequence
from qnext.engine.visual_encoder import VisionSetup
from qnext.engine.visual_intake import visual_prompt
from qnext.sampling_params import SamplingParams
from qnext.structured import GrammarCompiler, StructuredState
from qnext.structured import validate as validate_structured
from qnext.structured.thinking_budget import THINK_END, THINK_START, ThinkingBudget, prompt_inside_reasoning
from qnext.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | dict | list


class RequestIntake:
    def __init__(self, config: EngineConfig, cfg: ModelConfig, tokenizer: Tokenizer | None, max_model_len: int,
                 vision: VisionSetup | None = None):
        """vision: the checkpoint's tower, for prompts with multi_modal_data (engine/visual_intake.py)."""
        self.config, self.model_config, self.tokenizer = config, cfg, tokenizer
        self.vision = vision
        self.max_model_len = max_model_len
        self._turn_start_id = None if tokenizer is None else tokenizer.token_to_id("<|im_start|>")
        self._arrivals = 0           # the arrival index of the next sample (its seed stream when unseeded)
        self._grammar_compiler = None if tokenizer is None else _background(
            GrammarCompiler.for_tokenizer, tokenizer, cfg.vocab_size, cfg.eos_token_ids or tokenizer.eos_token_ids)

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
        if params.structured_outputs is not None:
            validate_structured(params, self.grammar_compiler())

    def grammar_compiler(self) -> GrammarCompiler | None:
        return self._grammar_compiler.result() if self._grammar_compiler is not None else None

    def samples(self, request_id: str, prompt: Prompt, params: SamplingParams) -> list[Sequence]:
        """The request's n samples, validated; with n > 1 the first carries the others as pending forks (one
        admission and prefill; the rest are forked after it, docs/engine.md)."""
        visuals = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            text, token_ids, visuals = visual_prompt(prompt, self.tokenizer, self.vision)
        else:
            text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        token_ids = [int(t) for t in token_ids]
        samples = [self._sample(request_id, token_ids, text, params, i) for i in range(params.n)]
        for sample in samples:
            sample.visuals = visuals
        if params.n > 1:
            for sample in samples:
                sample.group = samples
            samples[0].pending_forks = samples[1:]
        return samples

    def _sample(self, request_id: str, token_ids: list[int], text, params: SamplingParams, index: int) -> Sequence:
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
        seq = Sequence(request_id if index == 0 else f"{request_id}#{index}", token_ids, params, self._arrivals,
                       prompt=text, detokenizer=detokenizer, index=index, structured=structured,
                       thinking=self._thinking_budget(token_ids, params), turn_starts=self._turn_starts(token_ids))
        self._arrivals += 1
        return seq

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
