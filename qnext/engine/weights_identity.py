"""What an engine computes with, as digests: the weights' digest a persisted prefix cache is bound to (its
fingerprint, engine/cache_setup.py), and the model identity every PD transfer and every rank's handshake carries
(two processes that agree on it compute the same model). Computed once each, and forgotten when the weights are
replaced (LLMEngine.update_weights)."""
from __future__ import annotations

from pathlib import Path

from cache.fingerprint import files_digest, files_digest_memoized
from qnext.config import ModelConfig
from qnext.engine.cache_setup import model_identity_digest, params_weights_digest, prefix_cache_fingerprint
from qnext.engine.config import EngineConfig

WEIGHTS_DIGEST_MEMO = "weights_digest.json"   # in prefix_cache_dir: the checkpoint's digest, by file sizes and times


class WeightsIdentity:
    def __init__(self, checkpoint_files: list[Path] | None = None, prefix_cache_dir: str | Path | None = None):
        """checkpoint_files: the weights' files as loaded (None: in-memory weights, digested from the params).
        prefix_cache_dir: where the checkpoint's digest is memoized (by file sizes and times) for a persisted
        cache."""
        self._files = checkpoint_files
        self._weights_digest: str | None = None      # of the weights the cache was computed with
        self._identity: str | None = None
        if checkpoint_files is not None and prefix_cache_dir is not None:
            memo = Path(prefix_cache_dir) / WEIGHTS_DIGEST_MEMO
            self._weights_digest = files_digest_memoized(checkpoint_files, memo)

    def cache_fingerprint(self, cfg: ModelConfig, config: EngineConfig, params) -> dict:
        """The persisted prefix cache's fingerprint (the params' digest when no file digest is known)."""
        if self._weights_digest is None:
            self._weights_digest = params_weights_digest(params)
        return prefix_cache_fingerprint(cfg, config, self._weights_digest)

    def model_identity(self, cfg: ModelConfig, config: EngineConfig, params) -> str:
        """A digest of the model's config (its parallel layout and kernels aside), the engine's dtypes and the
        weights (the checkpoint's files as loaded, so equal for every tensor-parallel size; the in-memory params
        otherwise)."""
        if self._identity is None:
            if self._files is None:
                weights = params_weights_digest(params)
            else:                # the persisted cache's memoized digest of the same files, when it has one
                weights = self._weights_digest or files_digest(self._files)
            self._identity = model_identity_digest(cfg, weights, config.dtype, config.fp8_weights)
        return self._identity

    def weights_replaced(self) -> None:
        """New weights in place: every digest is computed again from the params when next asked."""
        self._files = self._weights_digest = self._identity = None
