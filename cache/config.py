"""CacheConfig: the sizes and switches the cache manager is built with."""
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int              # KV blocks including the reserved dummy block 0 (never handed out)
    num_live_slots: int          # live state rows are 1..num_live_slots (row 0 = dummy)
    num_snapshot_slots: int      # snapshot rows are first_snapshot_row .. first_snapshot_row+num_snapshot_slots-1
    enable_prefix_caching: bool = True
    hybrid: bool = True          # False: plain transformer, reuse = KV match, no snapshots needed
    checkpoint_interval: int = 1024  # prompts also capture at multiples of this, at most 8 a prompt (the spacing
                                     # doubles on longer prompts: cache/checkpoint_spacing.py; floored to blocks; 0: off)
    num_host_blocks: int = 0     # host-tier KV block slots (cache/tiers.py; 0: evicted blocks are dropped)
    num_host_snapshot_slots: int = 0  # host-tier snapshot slots (0: evicted snapshots are dropped)
    num_staging_rows: int = 0    # narrow snapshot pool: float32 rows after the live rows that the step stages
                                 # mid-sequence captures in (cache/device_buffers.py); snapshot ids follow them

    @property
    def first_snapshot_row(self) -> int:
        return self.num_live_slots + 1 + self.num_staging_rows

    def __post_init__(self):
        if self.block_size <= 0 or self.num_blocks < 2 or self.num_live_slots < 1 or self.num_snapshot_slots < 0:
            raise ValueError(f"{self}: need block_size > 0, num_blocks >= 2 (block 0 is the dummy), "
                             "num_live_slots >= 1, num_snapshot_slots >= 0")
        if self.num_host_blocks < 0 or self.num_host_snapshot_slots < 0:
            raise ValueError(f"num_host_blocks={self.num_host_blocks}, num_host_snapshot_slots="
                             f"{self.num_host_snapshot_slots}: need >= 0 (0: no host tier)")
        if self.num_staging_rows < 0:
            raise ValueError(f"num_staging_rows={self.num_staging_rows} must be >= 0")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval={self.checkpoint_interval} must be >= 0 (0 turns it off)")
