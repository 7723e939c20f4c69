"""The engine's two ends of prefill/decode disaggregation (docs/pd.md): the prefill side's exports after the step
that ran a prompt, and the decode side's intake of a request whose prompt was computed elsewhere."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import jax

from cache import CacheManager
from cache.hashing import block_hashes
from cache.device_buffers import CacheBuffers
from qnext.config import ModelConfig
from qnext.engine.engine_cache import EngineCache
from qnext.engine.pd_transfer import (BundleSource, PeerMismatchError, PrefillBundle, TransferredPrompt,
                                      bundle_nbytes, cache_layout_meta, check_model, export_prefill, first_token,
                                      stage_transferred)
from qnext.engine.postprocess import append_sampled
from qnext.engine.sampled_token import SampledToken
from qnext.engine.sequence import Sequence

logger = logging.getLogger("qnext.engine")

DEFAULT_BUNDLE_TTL_S = 120.0            # --pd-bundle-ttl
DEFAULT_MAX_BUNDLE_BYTES = 8 << 30      # --pd-max-bundle-bytes


class PrefillExports:
    """The bundles of a prefill engine's requests, from the step that ran their prompts until they are taken
    (any thread may take one). Bounded: a bundle nobody took within `ttl_s` is dropped, and so are the oldest
    ones while the bundles hold more than `max_bytes` (host memory); both at the next export (`limit` sets them)."""

    def __init__(self, cfg: ModelConfig, tp: int, block_size: int, kv_cache_scale: float, model_identity,
                 ttl_s: float = DEFAULT_BUNDLE_TTL_S, max_bytes: int = DEFAULT_MAX_BUNDLE_BYTES):
        """model_identity: () -> str, the engine's (LLMEngine.model_identity), put into every bundle."""
        self.cfg, self.tp, self.block_size, self.kv_cache_scale = cfg, tp, block_size, float(kv_cache_scale)
        self.model_identity = model_identity
        self.limit(ttl_s, max_bytes)
        self._bundles: dict[str, tuple[float, PrefillBundle]] = {}     # oldest first
        self._lock = threading.Lock()

    def limit(self, ttl_s: float, max_bytes: int) -> None:
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError(f"a prefill bundle's time to live ({ttl_s} s) and the bundles' byte bound ({max_bytes}) "
                             "must be positive")
        self.ttl_s, self.max_bytes = float(ttl_s), int(max_bytes)

    def layout(self, buffers: CacheBuffers) -> dict:
        return cache_layout_meta(self.cfg, buffers, self.block_size, self.kv_cache_scale)

    def export(self, prefilled: list[tuple[Sequence, list[int], int, SampledToken]], manager: CacheManager) -> None:
        """Reads the prompts the last step ran for export ((seq, block table, live row, first token) each) out of
        the buffers: right after the step's postprocess, before anything else writes their freed blocks or row."""
        buffers = manager.buffers
        layout, identity = self.layout(buffers), self.model_identity()
        now = time.monotonic()
        bundles = {seq.request_id: (now, export_prefill(
            buffers, self.cfg, self.tp, layout, identity, seq.request_id, seq.prompt_token_ids,
            block_hashes(seq.prompt_token_ids, self.block_size, manager.block_hash_fn), table, row, token,
            (seq.finish_reason, seq.stop_reason))) for seq, table, row, token in prefilled}
        with self._lock:
            self._bundles = {rid: b for rid, b in self._bundles.items() if now - b[0] < self.ttl_s}
            self._bundles.update(bundles)
            held = sum(bundle_nbytes(b.arrays) for _, b in self._bundles.values())
            while held > self.max_bytes and self._bundles:
                rid, (_, dropped) = next(iter(self._bundles.items()))
                del self._bundles[rid]
                held -= bundle_nbytes(dropped.arrays)
                logger.warning("prefill bundle %s dropped before its decode server took it: the bundles exceed "
                               "--pd-max-bundle-bytes %d", rid, self.max_bytes)

    def get(self, request_id: str) -> PrefillBundle | None:
        with self._lock:
            entry = self._bundles.get(request_id)
        return None if entry is None or time.monotonic() - entry[0] >= self.ttl_s else entry[1]

    def take(self, request_id: str) -> PrefillBundle | None:
        with self._lock:
            entry = self._bundles.pop(request_id, None)
        return None if entry is None or time.monotonic() - entry[0] >= self.ttl_s else entry[1]


@dataclasses.dataclass
class PendingTransfer:
    """A decode engine's request between its hold (engine thread) and the end of its fetch (any thread)."""
    seq: Sequence                  # fresh from intake
    meta: dict
    num_held_blocks: int
    buffer_shapes: CacheBuffers    # the engine's buffers as ShapeDtypeStructs (what to lay the arrays out for)
    cfg: ModelConfig
    tp: int
    staged: TransferredPrompt | None = None
    seconds: float = 0.0

    def fetch(self, source: BundleSource) -> None:
        """Fetches what the cache lacks and lays it out (touches no engine state: any thread)."""
        t0 = time.perf_counter()
        self.staged = stage_transferred(source, self.num_held_blocks, self.buffer_shapes, self.cfg, self.tp)
        self.seconds = time.perf_counter() - t0


def begin_transfer(seq: Sequence, meta: dict, cache: EngineCache, cfg: ModelConfig, tp: int, layout: dict,
                   model_identity: str, eos_token_ids, max_model_len: int) -> PendingTransfer:
    """Checks the bundle's metadata against `seq` (fresh from intake, n=1) and this engine, appends the first token
    (its stop check, detokenizer, grammar and logprobs as if sampled here), and holds the leading blocks this cache
    has (engine thread). ValueError when the request cannot continue here (the client's doing); PeerMismatchError
    when the two sides disagree; either way nothing is held."""
    if seq.group is not None or seq.visuals is not None:
        raise ValueError("prefill/decode disaggregation takes text prompts with n=1")
    try:
        if list(meta["prompt_token_ids"]) != seq.prompt_token_ids:
            raise ValueError(f"the prefill engine's prompt ({len(meta['prompt_token_ids'])} tokens) is not this "
                             f"request's ({len(seq.prompt_token_ids)} tokens): send both the same request")
        if meta["finish_reason"] != "prefilled":
            raise ValueError(f"the prefill engine finished this request ({meta['finish_reason']}): nothing to "
                             "decode")
        check_model(meta, layout, model_identity)
        num_blocks = -(-len(seq.prompt_token_ids) // layout["block_size"])
        token = first_token(meta)
        if meta["num_blocks"] != num_blocks or not 0 <= token.token_id < layout["vocab_size"]:
            raise PeerMismatchError(f"the prefill side's bundle has {meta['num_blocks']} blocks for {num_blocks} "
                                    f"and a first token {token.token_id} (vocabulary: {layout['vocab_size']})")
        stop = append_sampled(seq, token, eos_token_ids, max_model_len)
    except (KeyError, TypeError, AttributeError) as e:
        raise PeerMismatchError(f"the prefill side's bundle metadata is malformed ({e!r})") from None
    if stop is not None:
        raise ValueError(f"the first token ends this request here ({stop[0]}) but not on the prefill server: send "
                         "both servers the same request (sampling params, max_tokens) and give them the same "
                         "max_model_len")
    manager = cache.manager
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), manager.buffers)
    return PendingTransfer(seq, meta, manager.transferred.hold(seq.request_id, seq.prompt_token_ids), shapes, cfg, tp)


def finish_transfer(pending: PendingTransfer, cache: EngineCache) -> Sequence:
    """The fetched request (its fetch checked), ready for its TransferredPromptFeature (engine thread); a failure
    releases the hold."""
    seq = pending.seq
    if pending.staged is None:
        cache.manager.transferred.drop(seq.request_id)
        raise RuntimeError(f"request {seq.request_id!r}: its transfer was not fetched")
    return seq
