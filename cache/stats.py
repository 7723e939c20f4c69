"""Counters of the cache manager."""
from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0                  # served from cache (KV + restored state)
    kv_matched_tokens: int = 0              # raw KV match, capped so the last prompt token is computed
    lost_to_missing_state_tokens: int = 0   # KV matched but recomputed for want of a state snapshot
    admissions: int = 0
    admission_failures: int = 0
    snapshots_captured: int = 0
    snapshots_restored: int = 0
    snapshots_evicted: int = 0              # by the snapshot pool's LRU (KV kept)
    snapshots_invalidated: int = 0          # by eviction or clearing of their terminal KV block
    kv_blocks_evicted: int = 0
    peak_blocks_in_use: int = 0
    peak_slots_in_use: int = 0
    peak_snapshot_rows_in_use: int = 0

    @property
    def reuse_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "reuse_rate": self.reuse_rate}
