"""Model configuration: one frozen dataclass covers Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5`,
`qwen3_5_text`, `qwen3_5_moe`, `qwen3_5_moe_text`). It is hashable, so it can be a static argument under `jax.jit`.
`ModelConfig.from_pretrained` / `from_hf_config` build it from a Hugging Face config (parsed in qnext/hf_config.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

# read_json is imported from here by the loaders (qnext/model/loader.py, qnext/flax/model.py)
from qnext.hf_config import FULL_ATTENTION, LINEAR_ATTENTION, config_fields, pretrained_fields, read_json

__all__ = ["FULL_ATTENTION", "LINEAR_ATTENTION", "ModelConfig", "RopeScaling", "read_json"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Non-default RoPE scaling, with the field names of HF `rope_parameters` (YaRN uses all of them)."""

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    partial_rotary_factor: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    num_experts: int  # 0 = dense MLP in every layer
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    tensor_parallel_size: int = 1  # > 1 only in the per-device config of a sharded model (tensor_parallel.py)
    expert_parallel: bool = False  # tensor-parallel devices split the experts, not their units (EP)
    attention_tensor_parallel: bool = True  # False: the mixers and their cache run whole on every device
    backend: str | None = None     # "cpu" | "gpu": the kernels (Pallas on GPU, jnp references elsewhere) and layouts
                                   # the layers use; resolved once (with_backend), static under jit
    gpu_kernels: str | None = None  # "mosaic" | "triton": the Pallas GPU backend, chosen at engine start
                                    # (pallas_kernels/backend_choice.py); None: chosen by the ops on first use
    mrope_section: tuple[int, ...] = ()  # Qwen3.5: rotary frequencies per position axis (t, h, w), interleaved;
                                         # used only with 3-D positions (qnext/vision/mrope.py)
    kv_cache_scale: float = 1.0     # an fp8 KV cache stores value / kv_cache_scale (engine option, attention.py)

    def with_backend(self, backend: str | None = None) -> "ModelConfig":
        """This config with its backend resolved: the given one, else its own, else JAX's default backend."""
        if backend is None and self.backend is not None:
            return self
        import jax

        return dataclasses.replace(self, backend=backend or self.backend or jax.default_backend())

    @property
    def kernels(self) -> str:
        """The ops' implementation (pallas_kernels.api): the Pallas kernels on GPU (of the chosen backend), the jnp
        references elsewhere."""
        return (self.gpu_kernels or "pallas") if self.with_backend().backend == "gpu" else "reference"

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    def is_linear_layer(self, i: int) -> bool:
        return self.layer_types[i] == LINEAR_ATTENTION

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    # ---- constructors (the parsing is qnext/hf_config.py) ------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Reads `config.json` in a checkpoint directory (or the file itself). Extra stop ids from
        `generation_config.json` beside it are appended to `eos_token_ids`."""
        return cls._from_fields(pretrained_fields(path))

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a parsed Hugging Face config.json object; ValueError naming the field that is missing or wrong."""
        return cls._from_fields(config_fields(hf))

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> "ModelConfig":
        rope = fields["rope_scaling"]
        return cls(**{**fields, "rope_scaling": None if rope is None else RopeScaling(**rope)})
