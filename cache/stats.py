"""Counters of the cache manager, and of its host tier."""
from dataclasses import asdict, dataclass, field


@dataclass
class TierStats:
    """The host tier (cache/tiers.py): what moved between the tiers, what the host tier served, what it dropped.
    Bytes and seconds are counted where the copies run (cache/host_tier_buffers.py)."""
    host_hits: int = 0                  # admissions that loaded KV blocks or a snapshot back from the host tier
    host_hit_tokens: int = 0            # tokens whose KV was loaded back from the host tier
    device_hit_tokens: int = 0          # tokens whose KV was already on the device
    blocks_offloaded: int = 0           # device -> host, at device eviction
    blocks_loaded: int = 0              # host -> device, at admission
    snapshots_offloaded: int = 0
    snapshots_loaded: int = 0           # host -> a sequence's live row, at admission
    host_blocks_dropped: int = 0        # left the last tier (host LRU, or no room); their snapshots are invalidated
    host_snapshots_dropped: int = 0     # by the host tier's snapshot LRU
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    seconds_to_host: float = 0.0
    seconds_to_device: float = 0.0
    blocks_from_disk: int = 0           # loaded into the host tier at start (prefix_cache_dir)
    snapshots_from_disk: int = 0


@dataclass
class CacheStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0                  # served from cache (KV + restored state)
    transferred_tokens: int = 0             # prompt tokens computed by a prefill engine whose KV was moved here (PD)
    kv_matched_tokens: int = 0              # raw KV match, capped so the last prompt token is computed
    lost_to_missing_state_tokens: int = 0   # KV matched but recomputed for want of a state snapshot
    admissions: int = 0
    admission_failures: int = 0
    snapshots_captured: int = 0
    snapshots_restored: int = 0
    snapshots_evicted: int = 0              # by the snapshot pool's LRU (KV kept; offloaded if there is a host tier)
    snapshots_invalidated: int = 0          # by eviction or clearing of their terminal KV block from the last tier
    kv_blocks_evicted: int = 0              # from the device (offloaded if there is a host tier)
    peak_blocks_in_use: int = 0
    peak_slots_in_use: int = 0
    peak_snapshot_rows_in_use: int = 0
    tiers: TierStats = field(default_factory=TierStats)

    @property
    def reuse_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "reuse_rate": self.reuse_rate}

    def count_admission(self, seq, sign: int) -> None:
        """Counts an admission (a cache.records.SequenceRecord), or takes it back (sign -1: freed before it ran)."""
        self.admissions += sign
        self.prompt_tokens += sign * seq.prompt_len
        self.reused_tokens += sign * (seq.num_cached_tokens - seq.transferred_tokens)
        self.transferred_tokens += sign * seq.transferred_tokens
        self.kv_matched_tokens += sign * seq.kv_matched_tokens
        self.lost_to_missing_state_tokens += sign * (seq.kv_matched_tokens - seq.num_cached_tokens)
        self.snapshots_restored += sign * (seq.restored_hash is not None)
        self.tiers.device_hit_tokens += sign * (seq.num_cached_tokens - seq.host_tokens - seq.transferred_tokens)
        self.tiers.host_hit_tokens += sign * seq.host_tokens
        self.tiers.host_hits += sign * bool(seq.host_tokens or seq.snapshot_from_host)

    def track_peaks(self, blocks_in_use: int, slots_in_use: int, snapshot_rows_in_use: int) -> None:
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, blocks_in_use)
        self.peak_slots_in_use = max(self.peak_slots_in_use, slots_in_use)
        self.peak_snapshot_rows_in_use = max(self.peak_snapshot_rows_in_use, snapshot_rows_in_use)
