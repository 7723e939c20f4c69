"""Engine options, with vLLM's names where vLLM has the option."""
from __future__ import annotations

import dataclasses
import os

from cache.cache_dtypes import kv_storage_dtype, snapshot_storage_dtype
from qnext.config import ModelConfig
from qnext.engine.host_draft_options import HOST_DRAFT_METHODS, NGRAM_KEYS, SUFFIX_KEYS, HostDraftOptions, \
    host_draft_options
from qnext.model.rope import position_limit, position_limit_error


SPECULATIVE_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")   # vLLM's names for the same head
SPECULATIVE_KEYS = {"method", "num_speculative_tokens", "disable_by_batch_size", "speculative_token_map",
                    *SUFFIX_KEYS, *NGRAM_KEYS}
MAX_SPECULATIVE_TOKENS = 15            # and k + 1 <= block_size: a verify window spans at most one block boundary
HOST_DRAFT_TOKENS = 7                  # suffix drafting's default k and grammar fast-forward's most drafts a step: a
                                       # window of 8 positions stays within one 8-row group of XLA:CPU's GEMM


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    enable_prefix_caching: bool = True
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None          # None: min(max_position_embeddings, 4096)
    dtype: str = "float32"
    seed: int = 0
    num_gpu_blocks_override: int | None = None  # KV blocks (the dummy block 0 comes on top)
    gpu_memory_utilization: float = 0.9       # GPU: share of device memory for weights, activations and the cache
    kv_cache_memory_bytes: int | None = None  # the cache's byte budget (per device): KV + state rows; overrides ^
    snapshot_memory_fraction: float = 0.75    # share of the budget after the live rows that snapshots may take
    max_num_snapshots: int | None = None      # cap on prefix snapshot rows; None: the budget's bytes decide
                                              # (4 x max_num_seqs with num_gpu_blocks_override)
    snapshot_memory_bytes: int | None = None  # cap on the snapshot rows' bytes
    prefill_chunk: int | None = None          # rows per prefill group of the delta-rule kernel; None: by backend
    max_prefill_groups_extra: int = 8         # prefill groups a step may have beyond tokens / chunk
    num_scheduler_steps: int = 1              # decode steps per jitted call (1: one step per call)
    tensor_parallel_size: int = 1             # devices the model's heads are split over (tensor_parallel.py)
    enable_expert_parallel: bool = False      # the same devices split the MoE experts, not their units
    attention_tensor_parallel: bool = True    # False: attention / DeltaNet and their cache whole on every device
    context_parallel_size: int = 1            # devices a long prompt chunk is prefilled over (split by position;
                                              # qnext/model/context_parallel_step.py, docs/long-context.md)
    kv_offloading_size: float = 0.0           # GiB of host RAM for the cache's host tier (evicted KV blocks and
                                              # snapshots); 0: evictions are dropped (docs/cache.md)
    prefix_cache_dir: str | os.PathLike | None = None   # the prefix cache is written here at close(), read at start
    compilation_cache_dir: str | os.PathLike | None = None   # JAX's persistent compilation cache; None: the default
                                              # (~/.cache/qnext/jax), "none": off (engine/compilation_cache.py)
    speculative_config: dict | None = None    # vLLM's: {"method": "mtp", "num_speculative_tokens": k} drafts k
                                              # tokens a step with the checkpoint's MTP head (docs/speculative.md)
    grammar_fast_forward: bool = True         # tokens a grammar forces are verified as drafts in one window, where
                                              # windows run: one device, no LoRA, no MTP head (docs/structured.md)
    encoder_cache_bytes: int = 256 << 20      # vision tower outputs kept by image content hash (0: none kept)
    gpu_kernel_backend: str = "auto"          # Pallas GPU kernels: "auto" (Mosaic GPU on Hopper with JAX >= 0.10.2,
                                              # else Triton), "mosaic" or "triton" (pallas_kernels/backend_choice.py)
    kv_cache_dtype: str = "auto"              # vLLM's: "fp8" stores attention KV as e4m3 (cache/cache_dtypes.py)
    kv_cache_scale: float = 1.0               # fp8 KV: stored = value / scale (vLLM's default 1.0 for hybrids)
    mamba_ssm_cache_dtype: str = "auto"       # vLLM's: stored snapshots' recurrent state ("bfloat16"; auto: float32)
    enable_lora: bool = False                 # vLLM's: serve LoRA adapters (LoRARequest; docs/lora.md)
    max_loras: int = 1                        # vLLM's: adapters on device at once (one step mixes any of them)
    max_lora_rank: int = 16                   # vLLM's: the largest adapter rank accepted
    max_cpu_loras: int | None = None          # vLLM's: adapters kept in host memory, LRU (None: max_loras)
    fp8_weights: str = "auto"                 # an FP8 checkpoint's weights: "keep" (e4m3 + block scales on the
                                              # device), "dequantize" (widened at load); auto: keep on GPU (docs/fp8.md)

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk", "num_scheduler_steps",
                     "tensor_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            if name == "prefill_chunk" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        kv_storage_dtype(self.kv_cache_dtype, self.dtype), snapshot_storage_dtype(self.mamba_ssm_cache_dtype)
        if self.fp8_weights not in ("auto", "keep", "dequantize"):
            raise ValueError(f"fp8_weights must be 'auto', 'keep' or 'dequantize', got {self.fp8_weights!r}")
        if not isinstance(self.kv_cache_scale, (int, float)) or not self.kv_cache_scale > 0:
            raise ValueError(f"kv_cache_scale must be a positive number, got {self.kv_cache_scale!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.snapshot_memory_fraction, (int, float)) or not 0 <= self.snapshot_memory_fraction <= 1:
            raise ValueError(f"snapshot_memory_fraction must be in [0, 1], got {self.snapshot_memory_fraction!r}")
        for name in ("num_gpu_blocks_override", "max_num_snapshots", "snapshot_memory_bytes", "max_model_len",
                     "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        if not isinstance(self.kv_offloading_size, (int, float)) or self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got {self.kv_offloading_size!r}")
        if self.gpu_kernel_backend not in ("auto", "mosaic", "triton"):
            raise ValueError(f"gpu_kernel_backend must be 'auto', 'mosaic' or 'triton', got {self.gpu_kernel_backend!r}")
        if not isinstance(self.grammar_fast_forward, bool):
            raise ValueError(f"grammar_fast_forward must be True or False, got {self.grammar_fast_forward!r}")
        self.num_speculative_tokens          # validates speculative_config
        if self.speculative_config is not None:
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative decoding (speculative_config) runs on one device: set "
                                 "tensor_parallel_size=1 or drop speculative_config")
            if self.num_speculative_tokens + 1 > self.block_size:
                raise ValueError(f"a verify window of num_speculative_tokens + 1 = {self.num_speculative_tokens + 1} "
                                 f"tokens must fit one KV block (block_size {self.block_size})")
            if self.num_scheduler_steps > 1:
                raise ValueError("speculative decoding already runs several tokens per call: use "
                                 "num_scheduler_steps=1 with speculative_config")
        if self.enable_lora:
            for name in ("max_loras", "max_lora_rank"):
                if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                    raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
            if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                                   or self.max_cpu_loras < self.max_loras):
                raise ValueError(f"max_cpu_loras must be an integer of at least max_loras ({self.max_loras}), got "
                                 f"{self.max_cpu_loras!r}")
            for name, plain in (("tensor_parallel_size", 1), ("num_scheduler_steps", 1), ("speculative_config", None),
                                ("context_parallel_size", 1)):
                if getattr(self, name) != plain:
                    raise ValueError(f"enable_lora does not yet combine with {name}={getattr(self, name)!r}; "
                                     f"use {name}={plain!r} with LoRA")
        if self.context_parallel_size > 1:
            self._check_context_parallel()
        for name in ("prefix_cache_dir", "compilation_cache_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path, got {value!r}")

    def _check_context_parallel(self) -> None:
        """What context-parallel prefill does not combine with, named."""
        n = self.context_parallel_size
        if self.tensor_parallel_size > 1:
            raise ValueError(f"context_parallel_size={n} with tensor_parallel_size={self.tensor_parallel_size}: "
                             "context-parallel prefill runs the whole model on each device; use one of the two")
        if self.speculative_config is not None:
            raise ValueError(f"context_parallel_size={n} with speculative_config: the MTP drafter runs on one "
                             "device; drop one of the two")
        if snapshot_storage_dtype(self.mamba_ssm_cache_dtype) != "float32":
            raise ValueError(f"context_parallel_size={n} needs float32 snapshots (mamba_ssm_cache_dtype 'auto' or "
                             f"'float32'), got {self.mamba_ssm_cache_dtype!r}: the split step does not stage "
                             "snapshot rows through a narrow pool")

    @property
    def num_speculative_tokens(self) -> int:
        """k, the draft tokens a speculative step verifies (0: speculative decoding is off)."""
        spec = self.speculative_config
        if spec is None:
            return 0
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'mtp', 'num_speculative_tokens': 2}}, "
                             f"got {spec!r}")
        unknown = set(spec) - SPECULATIVE_KEYS
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; it takes "
                             f"{', '.join(map(repr, sorted(SPECULATIVE_KEYS)))}")
        if spec.get("method", "mtp") not in SPECULATIVE_METHODS + HOST_DRAFT_METHODS:
            raise ValueError(f"speculative_config method {spec.get('method')!r} is not supported; qnext drafts with "
                             f"the checkpoint's MTP head ({', '.join(SPECULATIVE_METHODS)}) or from the text "
                             f"({', '.join(HOST_DRAFT_METHODS)})")
        if spec.get("method") in HOST_DRAFT_METHODS:
            host_draft_options(spec)
        # suffix decoding chooses how many it drafts; num_speculative_tokens bounds it (default: the most)
        k = spec.get("num_speculative_tokens", HOST_DRAFT_TOKENS if spec.get("method") == "suffix" else None)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        limit = spec.get("disable_by_batch_size")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer (steps with more "
                             f"rows than this decode without drafts) or absent, got {limit!r}")
        token_map = spec.get("speculative_token_map")
        if token_map is not None and not isinstance(token_map, (str, os.PathLike)):
            raise ValueError(f"speculative_config speculative_token_map must be the path of a token id file (.npy "
                             f"or .json), got {token_map!r}")
        return k

    @property
    def speculative_token_map(self) -> str | None:
        """SGLang's speculative_token_map: the file of token ids the MTP head drafts over (None: the whole
        vocabulary); qnext/model/draft_vocab.py."""
        self.num_speculative_tokens                     # validates speculative_config
        token_map = (self.speculative_config or {}).get("speculative_token_map")
        return None if token_map is None else os.fspath(token_map)

    @property
    def speculative_max_rows(self) -> int | None:
        """vLLM's disable_by_batch_size: a step with more rows than this decodes plainly (None: no limit). Where
        the verify pass costs more than it saves (compute-bound batches) speculation pays only at small ones."""
        self.num_speculative_tokens                     # validates speculative_config
        return (self.speculative_config or {}).get("disable_by_batch_size")

    def speculation_disabled_at(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` rows decodes plainly under disable_by_batch_size."""
        max_rows = self.speculative_max_rows
        return max_rows is not None and num_rows > max_rows

    @property
    def uses_mtp_head(self) -> bool:
        """Whether speculative_config drafts with the checkpoint's MTP head (else: none, or drafts from the text)."""
        return bool(self.num_speculative_tokens) and self.speculative_config.get("method", "mtp") in SPECULATIVE_METHODS

    @property
    def host_drafting(self) -> HostDraftOptions | None:
        """The options of suffix / ngram drafting (host_draft_options.py), None for MTP or no speculation."""
        if not self.num_speculative_tokens or self.uses_mtp_head:
            return None
        return host_draft_options(self.speculative_config)

    @property
    def grammar_fast_forward_active(self) -> bool:
        """Whether grammar rows verify their forced tokens as drafts (grammar_fast_forward): the host-draft verify
        window (draft_verify.py) runs where speculative decoding could (one device) and applies no LoRA; with an
        MTP head a step verifies the head's drafts, whose acceptance applies no grammar mask."""
        return (self.grammar_fast_forward and self.tensor_parallel_size == 1 and not self.enable_lora
                and not self.uses_mtp_head)

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts a row verifies in one step: num_speculative_tokens with a speculative_config; with
        grammar fast-forward alone 7, within one KV block; 0: no step verifies drafts."""
        if self.num_speculative_tokens:
            return self.num_speculative_tokens
        return min(HOST_DRAFT_TOKENS, self.block_size - 1) if self.grammar_fast_forward_active else 0

    @property
    def num_mtp_kv_layers(self) -> int:
        """KV layers the cache holds beyond the model's: the MTP head's one attention layer when it drafts."""
        return 1 if self.uses_mtp_head else 0

    def resolved_prefill_chunk(self, backend: str) -> int:
        """The option, or by backend: 32 on CPU (XLA:CPU runs the chunked delta rule's small per-chunk matmuls
        faster at 32 rows than at 64: docs/bench/notes.md), 64 on GPU (the Triton kernels' block size, as FLA's)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return 32 if backend == "cpu" else 64

    def resolved_max_model_len(self, cfg: ModelConfig) -> int:
        limit = position_limit(cfg)
        if self.max_model_len is None:
            return min(limit, 4096)
        if self.max_model_len > limit:
            raise position_limit_error(cfg, self.max_model_len, f"max_model_len {self.max_model_len}")
        return self.max_model_len


def resolved_fp8_weights(choice: str, backend: str) -> str:
    """EngineConfig.fp8_weights with "auto" decided: "keep" on a GPU, "dequantize" elsewhere (the CPU widens the
    weights once at load rather than on every step)."""
    if choice != "auto":
        return choice
    return "keep" if backend == "gpu" else "dequantize"
