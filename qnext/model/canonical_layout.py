"""The cache's contents in a layout that does not depend on the tensor-parallel size, for moving KV blocks and state
rows between engines of different TP sizes (prefill/decode disaggregation, docs/pd.md).

Under tensor parallelism (qnext/model/tensor_parallel.py) the cache buffers, read back whole, are laid out for the
devices: the model is `sharded_model_config(cfg, tp)` (KV heads and DeltaNet key heads repeated in place where tp
exceeds them: head h -> copies h, h, ...), and the conv state's channels, the fused q | k | v segments, go
device-major (device r's slice holds q_r | k_r | v_r). The canonical layout is the global model's: KV pages
[Hkv, n, block_size, D] with each KV head once, conv state [K-1, conv_dim] with the channels in q | k | v order and
each key head once, recurrent state [Hv, dk, dv] (value heads are never replicated and their order is already
global). Re-slicing the concatenated conv rows without undoing the device-major order interleaves the segments
wrongly (SGLang #22060); these functions undo it.
"""
from __future__ import annotations

import numpy as np

from qnext.config import ModelConfig
from qnext.model.head_layout import device_major, repeat_heads
from qnext.model.tensor_parallel import sharded_model_config


def _split(cfg: ModelConfig, tp: int) -> bool:
    """Whether tp devices split the mixers' cache at all (else every device holds it whole, already canonical)."""
    return tp > 1 and cfg.attention_tensor_parallel


def _kv_times(cfg: ModelConfig, tp: int) -> int:
    return sharded_model_config(cfg, tp).num_key_value_heads // cfg.num_key_value_heads


def _conv_segments(cfg: ModelConfig) -> list[int]:
    return [cfg.key_dim, cfg.key_dim, cfg.value_dim]           # q | k | v channels


def kv_to_canonical(pages: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """Pages [Hkv(tp), n, bs, D] as the engine at `tp` holds them -> [Hkv, n, bs, D], each KV head once."""
    return pages[::_kv_times(cfg, tp)] if _split(cfg, tp) else pages


def kv_from_canonical(pages: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """[Hkv, n, bs, D] -> the layout of an engine at `tp` (KV heads repeated where tp exceeds them)."""
    return np.repeat(pages, _kv_times(cfg, tp), axis=0) if _split(cfg, tp) else pages


def _host_major(x: np.ndarray, axis: int, segments: list[int], tp: int) -> np.ndarray:
    """The inverse of head_layout.device_major: device r's slice [seg_0 r | seg_1 r | ...] -> [seg_0 | seg_1 ...]."""
    per_device = np.split(x, tp, axis=axis)
    bounds = np.cumsum([n // tp for n in segments])[:-1]
    parts = [np.split(d, bounds, axis=axis) for d in per_device]
    return np.concatenate([parts[r][j] for j in range(len(segments)) for r in range(tp)], axis=axis)


def conv_to_canonical(conv: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """Conv state [..., K-1, conv_dim(tp)] as the engine at `tp` holds it -> [..., K-1, conv_dim] in q | k | v order
    with each key head once."""
    if not _split(cfg, tp):
        return conv
    sharded = sharded_model_config(cfg, tp)
    x = _host_major(conv, conv.ndim - 1, _conv_segments(sharded), tp)
    times = sharded.linear_num_key_heads // cfg.linear_num_key_heads
    if times == 1:
        return x
    q, k, v = np.split(x, np.cumsum(_conv_segments(sharded))[:-1], axis=-1)
    dk = cfg.linear_key_head_dim

    def once(part):                   # [..., Hk * times * dk] -> [..., Hk * dk], the first copy of each head
        heads = part.reshape(part.shape[:-1] + (cfg.linear_num_key_heads, times, dk))
        return heads[..., 0, :].reshape(part.shape[:-1] + (cfg.key_dim,))
    return np.concatenate([once(q), once(k), v], axis=-1)


def conv_from_canonical(conv: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """[..., K-1, conv_dim] canonical -> the layout of an engine at `tp` (key heads repeated, device-major)."""
    if not _split(cfg, tp):
        return conv
    sharded = sharded_model_config(cfg, tp)
    times = sharded.linear_num_key_heads // cfg.linear_num_key_heads
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    x = repeat_heads(conv, conv.ndim - 1, _conv_segments(cfg), [(hk, times), (hk, times), (hv, 1)])
    return device_major(x, conv.ndim - 1, _conv_segments(sharded), tp)
