"""The offline API, shaped like vLLM's: LLM(model).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator, Sequence

from qnext.chat_pictures import take_pictures
from qnext.engine.llm_engine import LLMEngine, Prompt
from qnext.engine.visual_intake import visual_prompt
from qnext.lora.registry import LoRARequest
from qnext.outputs import RequestOutput
from qnext.sampling_params import SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """A Qwen3.5 / Qwen3-Next model served by the qnext engine.

    Engine options carry vLLM's names: enable_prefix_caching, block_size, max_num_seqs, max_num_batched_tokens,
    max_model_len, dtype, seed, num_gpu_blocks_override, kv_offloading_size (GiB of host RAM for evicted KV blocks
    and snapshots); plus max_num_snapshots and snapshot_memory_bytes for the prefix-snapshot pool of the
    linear-attention state, and prefix_cache_dir (the cache is written there at close() and read at start; use
    `with LLM(...) as llm:`), compilation_cache_dir (JAX's persistent compilation cache, on by default in
    ~/.cache/qnext/jax; "none" turns it off: qnext/engine/compilation_cache.py). warm_up=True compiles every step
    shape up front (reading each from the compilation cache when it has it).
    """

    def __init__(self, model: str | Path, *, warm_up: bool = False, progress=None, **engine_options):
        self.engine = LLMEngine(model, progress=progress, **engine_options)
        self._ids = itertools.count()
        if warm_up:
            if progress:
                progress("compiling step shapes")
            self.engine.warm_up()

    @classmethod
    def from_model(cls, model, tokenizer=None, *, warm_up: bool = False, **engine_options) -> "LLM":
        """An engine on a Flax model's current weights (qnext.flax.HybridCausalLM; no checkpoint directory).
        tokenizer: a Tokenizer, a directory with tokenizer.json, or None for the model's source checkpoint's (if
        it has one). dtype defaults to the module's; tensor parallelism as for a path."""
        from qnext.flax import HybridCausalLM, engine_params
        from qnext.tokenizer import Tokenizer

        if not isinstance(model, HybridCausalLM):
            raise TypeError(f"from_model takes a qnext.flax.HybridCausalLM, got {type(model).__name__}; "
                            "for a checkpoint directory use qnext.LLM(path)")
        cfg, params = engine_params(model)
        if tokenizer is None and model.source.directory is not None:
            source = Path(model.source.directory)
            tokenizer = Tokenizer.from_pretrained(source) if (source / "tokenizer.json").is_file() else None
        elif isinstance(tokenizer, (str, Path)):
            if not (Path(tokenizer) / "tokenizer.json").is_file():
                raise ValueError(f"{tokenizer} has no tokenizer.json; pass a directory with one, a Tokenizer or None")
            tokenizer = Tokenizer.from_pretrained(Path(tokenizer))
        engine_options.setdefault("dtype", str(params["embed"].dtype))
        llm = cls.__new__(cls)
        llm.engine = LLMEngine.from_params(cfg, params, tokenizer, **engine_options)
        llm._ids = itertools.count()
        if warm_up:
            llm.engine.warm_up()
        return llm

    def update_weights(self, model) -> None:
        """Copies the Flax model's current weights into the engine in place (no recompilation), its vision tower's
        too when both have one, and drops the whole prefix cache (its KV and snapshots came from the old weights)
        and the tower's cached outputs. Raises with requests in flight."""
        from qnext.flax import HybridCausalLM, engine_params, vision_params

        if not isinstance(model, HybridCausalLM):
            raise TypeError(f"update_weights takes a qnext.flax.HybridCausalLM, got {type(model).__name__}; "
                            "for a params pytree use llm.engine.update_weights(params)")
        tower = vision_params(model) if self.engine.vision is not None else None
        self.engine.update_weights(engine_params(model)[1], vision_params=tower)

    def cache_info(self) -> dict:
        """The cache's split (LLMEngine.cache_info): blocks, KV bytes, live and snapshot rows, state bytes, budget."""
        return self.engine.cache_info()

    def close(self) -> None:
        """Writes the prefix cache to `prefix_cache_dir` if one is set (LLMEngine.close); no requests after it."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of the prompts. lora_request: the
        adapter of every prompt, or a list with one per prompt (None: the base model); engine option enable_lora."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(prompt, p) for prompt, p in zip(prompts, params)]   # all valid before queuing
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts; give one per prompt")
        ids = [self._add(prompt, p, lora) for prompt, p, lora in zip(encoded, params, loras)]
        finished = self._run(ids)
        return [finished[i] for i in ids]

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Renders each conversation with the checkpoint's chat template, then generates. Messages may hold
        pictures: OpenAI's image_url / video_url content parts (data URLs), or PIL images and numpy arrays
        (qnext/chat_pictures.py)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(conv, add_generation_prompt, chat_template_kwargs) for conv in conversations]
        return self.generate(prompts, sampling_params)

    def chat_prompt(self, messages: Messages, add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> Prompt:
        """A conversation as a prompt for generate / stream: the rendered text, or, when its messages hold pictures,
        {"prompt": text with each picture's placeholder, "multi_modal_data": the pictures}."""
        messages, multi_modal_data = take_pictures(messages, self.engine.vision)
        text = self.render_chat(messages, add_generation_prompt, chat_template_kwargs)
        return text if multi_modal_data is None else {"prompt": text, "multi_modal_data": multi_modal_data}

    def render_chat(self, messages: Messages, add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json, so it has no chat template")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **(chat_template_kwargs or {}))

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[tuple[str | list[str], RequestOutput]]:
        """Yields (new text, output so far) for one request after every engine step that generated for it: one
        token, or up to num_scheduler_steps when decode steps run several to a call. With n > 1 the new text is a
        list, one entry per sample (out.outputs[i] is sample i)."""
        params = sampling_params or SamplingParams()
        request_id = self._add(self._encode(prompt, params), params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        deltas = [self.engine.stream_text(request_id, i) for i in range(params.n)]
                        yield deltas if params.n > 1 else deltas[0], out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)
            self.engine.release(request_id)

    # ---------------------------------------------------------------------------------------------------------
    def _encode(self, prompt: Prompt, params: SamplingParams) -> dict:
        """Tokenizes once and validates; the engine then takes the token ids as they are (and the pictures
        preprocessed)."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            text, token_ids, visuals = visual_prompt(prompt, self.engine.tokenizer, self.engine.vision)
            self.engine.validate(token_ids, params)
            return {"prompt": text, "prompt_token_ids": token_ids, "multi_modal_data": visuals.as_data()}
        text, token_ids = self.engine.tokenize(prompt)
        self.engine.validate(token_ids, params)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _add(self, prompt: Prompt, params: SamplingParams, lora_request: LoRARequest | None = None) -> str:
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, prompt, params, lora_request)
        return request_id

    def _run(self, ids: list[str]) -> dict[str, RequestOutput]:
        pending, finished = set(ids), {}
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
        finally:
            for request_id in ids:
                if request_id in pending:
                    self.engine.abort_request(request_id)
                self.engine.release(request_id)
        return finished

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params
