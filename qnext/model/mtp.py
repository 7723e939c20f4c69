"""The MTP (multi-token prediction) head of Qwen3-Next / Qwen3.5: weights, loading and saving, and its dense forward.

The checkpoints ship it as `mtp.*` (the decoder's loader skips it). Math, as vLLM's qwen3_next_mtp.py runs it: for a
slot t with the target's final-normed hidden state h_t and the token x_{t+1} that follows it,
    x = fc([norm_e(embed(x_{t+1})) ‖ norm_h(h_t)])           fc: [H, 2H]; zero-centred RMSNorms (1 + w)
    x = one decoder layer: gated full attention (at position t, over the head's own keys of slots <= t) and the
        model's MLP / MoE (as decoder layer 0 has it), pre-norm with residuals
    logits for x_{t+2} = lm_head(norm(x))                     embed and lm_head shared with the model
Drafting k > 1 tokens chains the head on its own output: slot t+1 takes x_{t+2} (its draft) and the head's own
hidden state at t (vLLM: spec_step_idx % num_mtp_layers with one layer).

Params pytree (engine layouts, docs/CONTRACTS.md):
    {"fc": [H, 2H], "pre_fc_norm_embedding": [H], "pre_fc_norm_hidden": [H], "norm": [H],
     "layer": {"input_norm", "post_attn_norm", "attn": a full-attention layer's, "mlp": layer 0's MLP or MoE}}
`save_mtp_params` writes it to `mtp.safetensors` in the checkpoint directory under the HF names, which
`load_mtp_params` prefers over `mtp.*` tensors inside the checkpoint's own files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnext.config import ModelConfig
from qnext.model import hf_export, loader
from qnext.model.dense import dense_full_attention
from qnext.ops.linear import linear
from qnext.model.mlp import feed_forward
from qnext.model.norms import rms_norm

PREFIX = "mtp."
LAYER = "mtp.layers.0."
MTP_FILE = "mtp.safetensors"


# ---- weights -------------------------------------------------------------------------------------------------------
class _MtpTensors:
    """The `mtp.*` tensors of a checkpoint directory: its own files, then mtp.safetensors (which wins)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = loader.checkpoint_files(path)
        if (path / MTP_FILE).is_file():
            files = files + [path / MTP_FILE]
        self._arrays: dict[str, Any] = {}
        for f in files:
            with safe_open(str(f), framework="numpy") as handle:
                for name in handle.keys():
                    if name.startswith(PREFIX):
                        self._arrays[name] = handle.get_tensor(name)

    def __bool__(self) -> bool:
        return bool(self._arrays)

    def has(self, name: str) -> bool:
        return name in self._arrays

    def read(self, name: str) -> np.ndarray:
        return self._arrays[name]


def _plan(t: _MtpTensors, cfg: ModelConfig) -> dict[str, Any]:
    H, same = cfg.hidden_size, loader._same
    return {
        "fc": same(PREFIX + "fc.weight", H, 2 * H),
        "pre_fc_norm_embedding": same(PREFIX + "pre_fc_norm_embedding.weight", H),
        "pre_fc_norm_hidden": same(PREFIX + "pre_fc_norm_hidden.weight", H),
        "norm": same(PREFIX + "norm.weight", H),
        "layer": {
            "input_norm": same(LAYER + "input_layernorm.weight", H),
            "post_attn_norm": same(LAYER + "post_attention_layernorm.weight", H),
            "attn": loader._full_attention(t, LAYER + "self_attn.", cfg),
            "mlp": loader._moe(t, LAYER + "mlp.", cfg) if cfg.is_moe_layer(0) else loader._dense_mlp(LAYER + "mlp.", cfg),
        },
    }


def load_mtp_params(path: str | Path, cfg: ModelConfig, dtype: Any = "float32") -> dict | None:
    """The checkpoint's MTP head as jax arrays (None when it has no `mtp.*` tensors). Shapes are checked."""
    t = _MtpTensors(Path(path))
    if not t:
        return None

    def build(leaf):
        for name, shape in leaf.sources:
            if not t.has(name):
                raise loader.CheckpointError(f"the MTP head in {path} has no tensor {name!r}")
            if tuple(t.read(name).shape) != tuple(shape):
                raise loader.CheckpointError(f"MTP tensor {name!r} has shape {t.read(name).shape}; the config "
                                             f"expects {tuple(shape)}")
        out = leaf.combine(*(t.read(name) for name, _ in leaf.sources))
        return jnp.asarray(np.ascontiguousarray(out), dtype)

    return jax.tree.map(build, _plan(t, cfg), is_leaf=lambda x: isinstance(x, loader._Leaf))


def mtp_hf_tensors(mtp: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The head as HF-named numpy tensors (the inverse of load_mtp_params)."""
    out = {PREFIX + k + ".weight": np.asarray(mtp[k], np.float32)
           for k in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    layer = mtp["layer"]
    out[LAYER + "input_layernorm.weight"] = np.asarray(layer["input_norm"], np.float32)
    out[LAYER + "post_attention_layernorm.weight"] = np.asarray(layer["post_attn_norm"], np.float32)
    out.update(hf_export._full_attention({k: np.asarray(v, np.float32) for k, v in layer["attn"].items()},
                                         LAYER + "self_attn.", cfg))
    mlp = {k: np.asarray(v, np.float32) for k, v in layer["mlp"].items()}
    out.update(hf_export._moe(mlp, LAYER + "mlp.", cfg, False) if cfg.is_moe_layer(0)
               else hf_export._dense_mlp(mlp, LAYER + "mlp."))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_mtp_params(path: str | Path, mtp: dict, cfg: ModelConfig) -> Path:
    """Writes the head into the checkpoint directory as mtp.safetensors (the decoder's files are untouched)."""
    from safetensors.numpy import save_file

    out = Path(path) / MTP_FILE
    save_file(mtp_hf_tensors(mtp, cfg), str(out))
    return out


def init_mtp_params(params: dict, cfg: ModelConfig, key) -> dict:
    """A fresh head for training: the decoder's last full-attention layer copied (attention and MLP shapes match
    layer 0's when both are MoE or both dense), unit norms (w = 0), and fc passing the hidden state through with
    a small random mix of the embedding."""
    H = cfg.hidden_size
    last_full = max(i for i in range(cfg.num_hidden_layers) if not cfg.is_linear_layer(i))
    if cfg.is_moe_layer(last_full) != cfg.is_moe_layer(0):
        raise ValueError("the MTP layer's MLP kind differs from the last full-attention layer's; init it otherwise")
    dtype = params["embed"].dtype
    fc = jnp.concatenate([0.02 * jax.random.normal(key, (H, H)), jnp.eye(H)], axis=1).astype(dtype)
    zeros = jnp.zeros((H,), dtype)
    return {"fc": fc, "pre_fc_norm_embedding": zeros, "pre_fc_norm_hidden": zeros, "norm": params["final_norm"],
            "layer": jax.tree.map(jnp.array, params["layers"][last_full])}


# ---- dense forward (training and the reference speculative loop; the target's is model/dense.py) ---------------
def mtp_forward(params, mtp, next_ids, hidden, cfg: ModelConfig):
    """next_ids: [B, S] the tokens x_{t+1} of slots t = 0..S-1; hidden: [B, S, H] the hidden state of each slot
    (the target's, or the head's own when chaining). Returns (logits [B, S, V] for x_{t+2}, the head's normed
    hidden [B, S, H], which chaining feeds back as vLLM does). Slots are positions 0..S-1, attending causally
    among themselves."""
    eps = cfg.rms_norm_eps
    e = rms_norm(params["embed"][next_ids], mtp["pre_fc_norm_embedding"], eps)
    h = rms_norm(hidden, mtp["pre_fc_norm_hidden"], eps)
    x = linear(jnp.concatenate([e, h.astype(e.dtype)], axis=-1), mtp["fc"])
    b, s = next_ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    layer = mtp["layer"]
    x = x + dense_full_attention(layer["attn"], rms_norm(x, layer["input_norm"], eps), positions,
                                 jnp.ones((b, s), bool), cfg)
    x = x + feed_forward(layer["mlp"], rms_norm(x, layer["post_attn_norm"], eps), cfg, 0)
    h = rms_norm(x, mtp["norm"], eps)
    return linear(h, params["lm_head"], preferred_element_type=jnp.float32), h
