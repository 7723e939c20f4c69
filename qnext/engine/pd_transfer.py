"""What moves from a prefill engine to a decode engine for one request (prefill/decode disaggregation,
docs/pd.md), in a layout independent of either side's tensor-parallel size (qnext/model/canonical_layout.py).

A `PrefillBundle` is the prefill side's export at exactly the last prompt token: the metadata (the prompt, its
chain block hashes, the first sampled token with its logprob, how the request finished there, the cache layout)
and the arrays: every KV layer's blocks of the prompt (`kv.{i}.k` / `kv.{i}.v` [Hkv, num_blocks, block_size, D],
the MTP head's layer last when the prefill engine has one, the partial last block with its positions past the
prompt zeroed) and ONE state, the live row after the prompt's last token (`conv.{i}` [K-1, conv_dim],
`recurrent.{i}` [Hv, dk, dv] float32). Nothing is recomputed on the decode side: the state is the one after token
N, not after N-1 (vLLM #37310).

The decode side reads it through a `BundleSource` (`meta`, `fetch(first_block, num_kv_layers)`): it asks only for
the blocks its own prefix cache does not hold and the KV layers it has, so `fetch` moves the minimum. It trusts
nothing it gets: the model identity and the layout must be its own, and every fetched array must have the name,
shape and dtype the metadata implies (`expected_arrays`) before any of it touches the cache. An in-process
bundle is its own source; qnext/server/pd_mover.py fetches one from another process.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from cache.buffer_copies import gather_device_blocks, gather_live_rows
from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.engine.sampled_token import SampledToken
from qnext.model.canonical_layout import conv_from_canonical, conv_to_canonical, kv_from_canonical, kv_to_canonical

PREFILLED = "prefilled"        # finish_reason of a request whose decoding continues on a decode engine


class PeerMismatchError(ValueError):
    """The prefill side's bundle does not fit this decode engine: another model, another cache layout, or arrays
    other than the metadata announced. Not the client's fault: the two servers disagree."""


def cache_layout_meta(cfg: ModelConfig, buffers: CacheBuffers, block_size: int, kv_cache_scale: float) -> dict:
    """The canonical layout of an engine's cache: what must agree between the two sides (the MTP layer need not)."""
    num_mtp = len(buffers.kv) - len(cfg.full_layer_ids)
    state = {}
    if buffers.conv:
        state = {"conv_shape": [cfg.linear_conv_kernel_dim - 1, cfg.conv_dim], "conv_dtype": buffers.conv[0].dtype.name,
                 "recurrent_shape": [cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim]}
    return {"block_size": block_size, "num_model_kv_layers": len(cfg.full_layer_ids), "num_mtp_kv_layers": num_mtp,
            "num_kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "kv_dtype": buffers.kv[0][0].dtype.name if buffers.kv else None, "kv_cache_scale": kv_cache_scale,
            "num_state_layers": len(buffers.conv), "vocab_size": cfg.vocab_size, **state}


def check_model(meta: dict, layout: dict, model_identity: str) -> None:
    """PeerMismatchError naming what differs between the bundle's model and cache layout and this engine's."""
    if meta.get("model_identity") != model_identity:
        raise PeerMismatchError(f"the prefill engine computes another model (identity {meta.get('model_identity')!r}, "
                                f"this decode engine's {model_identity!r}): both sides must load the same weights "
                                "with the same dtypes")
    check_layouts(meta["layout"], layout)


def check_layouts(prefill: dict, decode: dict) -> None:
    """PeerMismatchError naming what differs between the prefill engine's cache layout and this one's."""
    for key in sorted(set(prefill) | set(decode)):
        if key != "num_mtp_kv_layers" and prefill.get(key) != decode.get(key):
            raise PeerMismatchError(f"the prefill engine's cache has {key}={prefill.get(key)!r}, this decode engine's "
                             f"{decode.get(key)!r}: both sides must serve the same model with the same cache options")


@dataclasses.dataclass
class PrefillBundle:
    meta: dict                     # json-able: request_id, prompt_token_ids, block_hashes (hex), first_token, ...
    arrays: dict[str, np.ndarray]  # canonical layout (module docstring)

    def fetch(self, first_block: int, num_kv_layers: int) -> dict[str, np.ndarray]:
        """The KV of blocks first_block.. of the first num_kv_layers layers, and the state: what a decode engine
        holding blocks 0..first_block-1 needs."""
        out = {}
        for name, a in self.arrays.items():
            if name.startswith("kv."):
                if int(name.split(".")[1]) < num_kv_layers:
                    out[name] = a[:, first_block:]
            else:
                out[name] = a
        return out


class BundleSource(Protocol):
    meta: dict

    def fetch(self, first_block: int, num_kv_layers: int) -> dict[str, np.ndarray]: ...


def expected_arrays(meta: dict, first_block: int, num_kv_layers: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of what `fetch(first_block, num_kv_layers)` must return for a bundle with this
    metadata (its layout checked against this engine's): what a decode engine checks the arrays against before
    they touch its cache, and asks a remote prefill server for."""
    layout = meta["layout"]
    missing = meta["num_blocks"] - first_block
    num_layers = min(num_kv_layers, layout["num_model_kv_layers"] + layout["num_mtp_kv_layers"])
    kv = ((layout["num_kv_heads"], missing, layout["block_size"], layout["head_dim"]), layout["kv_dtype"])
    out = {f"kv.{i}.{part}": kv for i in range(num_layers) for part in ("k", "v")}
    for i in range(layout["num_state_layers"]):
        out[f"conv.{i}"] = tuple(layout["conv_shape"]), layout["conv_dtype"]
        out[f"recurrent.{i}"] = tuple(layout["recurrent_shape"]), "float32"
    return out


def check_arrays(arrays: dict[str, np.ndarray], expected: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """PeerMismatchError unless `arrays` are exactly the expected names, shapes and dtypes."""
    if set(arrays) != set(expected):
        raise PeerMismatchError(f"the prefill side sent arrays {sorted(arrays)}; expected {sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        a = arrays[name]
        if tuple(a.shape) != tuple(shape) or np.dtype(a.dtype).name != dtype:
            raise PeerMismatchError(f"the prefill side sent {name} as {np.dtype(a.dtype).name}{list(a.shape)}; "
                                    f"its metadata announced {dtype}{list(shape)}")


def export_prefill(buffers: CacheBuffers, cfg: ModelConfig, tp: int, layout: dict, model_identity: str,
                   request_id: str, prompt_token_ids: list[int], block_hashes: list[bytes], block_table: list[int],
                   state_row: int, first: SampledToken, finish: tuple) -> PrefillBundle:
    """The bundle of a request whose prompt step just ran (its blocks and live row still hold what it wrote)."""
    n, bs = len(prompt_token_ids), layout["block_size"]
    num_blocks = -(-n // bs)
    arrays = {}
    for i, (k, v) in enumerate(gather_device_blocks(buffers.kv, block_table[:num_blocks])):
        for part, pages in (("k", k), ("v", v)):
            pages = np.array(kv_to_canonical(pages, cfg, tp))
            pages[:, -1, n - (num_blocks - 1) * bs:] = 0          # past the prompt: not computed
            arrays[f"kv.{i}.{part}"] = pages
    conv, recurrent = gather_live_rows(buffers, [state_row])   # float32 whatever the snapshot pool's dtype
    for i, (c, r) in enumerate(zip(conv, recurrent)):
        arrays[f"conv.{i}"] = np.ascontiguousarray(conv_to_canonical(c[0], cfg, tp))
        arrays[f"recurrent.{i}"] = r[0]
    token = {"token_id": first.token_id, "logprob": first.logprob, "rank": first.rank,
             "top_ids": None if first.top_ids is None else np.asarray(first.top_ids).tolist(),
             "top_logprobs": None if first.top_logprobs is None else np.asarray(first.top_logprobs).tolist()}
    meta = {"request_id": request_id, "model_identity": model_identity, "prompt_token_ids": list(prompt_token_ids),
            "layout": layout,
            "block_hashes": [h.hex() for h in block_hashes], "num_blocks": num_blocks, "first_token": token,
            "finish_reason": finish[0], "stop_reason": finish[1]}
    return PrefillBundle(meta, arrays)


def first_token(meta: dict) -> SampledToken:
    t = meta["first_token"]
    top = t["top_ids"] is not None
    return SampledToken(t["token_id"], t["logprob"], t["rank"], np.asarray(t["top_ids"]) if top else None,
                        np.asarray(t["top_logprobs"]) if top else None)


def bundle_nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


@dataclasses.dataclass
class TransferredPrompt:
    """A decode engine's copy of what it fetched, in its own layout, until the request is admitted."""
    num_held_blocks: int           # leading blocks its own cache holds (cache.CacheManager.transferred.hold)
    kv: tuple                      # per KV layer of its buffers (k, v) [Hkv(tp), missing blocks, bs, D]
    conv: tuple                    # per linear-attention layer [1, K-1, conv_dim(tp)]
    recurrent: tuple               # per linear-attention layer [1, Hv, dk, dv]
    bytes_moved: int               # what fetch returned
    min_bytes: int                 # missing blocks x canonical block bytes (this engine's KV layers) + one state


def stage_transferred(source: BundleSource, num_held_blocks: int, buffers: CacheBuffers, cfg: ModelConfig,
                      tp: int) -> TransferredPrompt:
    """Fetches what this engine's cache lacks (blocks num_held_blocks.. and the state) and lays it out for `tp`.
    KV layers of this engine that the bundle lacks (the MTP head's, when only this side drafts) are zeros: the
    head's KV affects only its drafts, which the target verifies."""
    meta = source.meta
    missing = meta["num_blocks"] - num_held_blocks
    num_layers = len(buffers.kv)
    fetched = source.fetch(num_held_blocks, num_layers)
    check_arrays(fetched, expected_arrays(meta, num_held_blocks, num_layers))
    have = meta["layout"]["num_model_kv_layers"] + meta["layout"]["num_mtp_kv_layers"]
    kv, block_bytes = [], 0
    for i, (k, _) in enumerate(buffers.kv):
        if i < have:
            pair = tuple(kv_from_canonical(fetched[f"kv.{i}.{part}"], cfg, tp) for part in ("k", "v"))
            block_bytes += 2 * fetched[f"kv.{i}.k"][:, :1].nbytes
        else:
            zeros = np.zeros((k.shape[0], missing) + tuple(k.shape[2:]), k.dtype)
            pair = (zeros, zeros)
        kv.append(pair)
    conv = tuple(conv_from_canonical(fetched[f"conv.{i}"], cfg, tp)[None] for i in range(len(buffers.conv)))
    recurrent = tuple(fetched[f"recurrent.{i}"][None] for i in range(len(buffers.recurrent)))
    state_bytes = sum(fetched[f"{part}.{i}"].nbytes for part in ("conv", "recurrent")
                      for i in range(len(buffers.conv)))
    return TransferredPrompt(num_held_blocks, tuple(kv), conv, recurrent, bundle_nbytes(fetched),
                             missing * block_bytes + state_bytes)
