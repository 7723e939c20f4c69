"""CacheConfig: the sizes and switches the cache manager is built with."""
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int              # KV blocks including the reserved dummy block 0 (never handed out)
    num_live_slots: int          # live state rows are 1..num_live_slots (row 0 = dummy)
    num_snapshot_slots: int      # snapshot rows are num_live_slots+1 .. num_live_slots+num_snapshot_slots
    enable_prefix_caching: bool = True
    hybrid: bool = True          # False: plain transformer, reuse = KV match, no snapshots needed
    checkpoint_interval: int = 1024  # prompts also capture at multiples of this, at most 8 a prompt (the spacing
                                     # doubles on longer prompts: cache/checkpoints.py; floored to blocks; 0: off)
    num_host_blocks: int = 0     # host-tier KV block slots (cache/tiers.py; 0: evicted blocks are dropped)
    num_host_snapshot_slots: int = 0  # host-tier snapshot slots (0: evicted snapshots are dropped)

    def __post_init__(self):
        if self.block_size <= 0 or self.num_blocks < 2 or self.num_live_slots < 1 or self.num_snapshot_slots < 0:
            raise ValueError(f"{self}: need block_size > 0, num_blocks >= 2 (block 0 is the dummy), "
                             "num_live_slots >= 1, num_snapshot_slots >= 0")
        if self.num_host_blocks < 0 or self.num_host_snapshot_slots < 0:
            raise ValueError(f"num_host_blocks={self.num_host_blocks}, num_host_snapshot_slots="
                             f"{self.num_host_snapshot_slots}: need >= 0 (0: no host tier)")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval={self.checkpoint_interval} must be >= 0 (0 turns it off)")
