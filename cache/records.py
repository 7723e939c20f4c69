"""The cache manager's records: what an admission returns, and what it keeps per admitted sequence."""
from dataclasses import dataclass, field

from cache.image_keys import ImageSpan


@dataclass(frozen=True)
class Admission:
    num_cached_tokens: int       # tokens served from cache (a multiple of block_size, <= prompt_len - 1)
    block_table: list[int]       # blocks covering the whole prompt (shared cached ones first, then fresh)
    state_row: int               # the sequence's live state row
    restore_row: int | None      # row holding the state after num_cached_tokens tokens (None if 0 cached): a
                                 # snapshot row, or the live state_row when the snapshot is loaded from the host tier
    kv_matched_tokens: int       # raw KV match before trimming to a usable snapshot (also <= prompt_len - 1)


@dataclass
class SequenceRecord:
    prompt_len: int
    hashes: list[bytes]                      # chain hashes of the full blocks known so far
    block_table: list[int]
    state_row: int
    num_cached_tokens: int
    chain: list[int]                         # cached block of each published position: own, or a twin's original
    capture_plan: list[int] = field(default_factory=list)
    pinned_row: int | None = None            # restore snapshot, pinned until the first commit
    snapshot_from_host: bool = False         # the restored snapshot comes from the host tier ...
    restored_in_live_row: bool = False       # ... into state_row (no snapshot row could be had for it)
    pending_captures: dict[int, int] = field(default_factory=dict)  # position -> reserved row
    decode_row: int | None = None
    decode_position: int = 0
    branch_position: int = 0                 # where the KV match outran the state match (0: it did not)
    restored_hash: bytes | None = None
    restored_origin: str | None = None       # why the restored snapshot was captured (snapshot_lifecycle.py)
    kv_matched_tokens: int = 0
    transferred_tokens: int = 0              # of num_cached_tokens, those whose KV came with a transfer (PD)
    host_tokens: int = 0                     # of num_cached_tokens, those whose KV is loaded from the host tier
    ran: bool = False                        # a step committed for it (else free() takes back its admission counts)
    cacheable: bool = True                   # False once a clear ran while it was admitted: it publishes nothing more
    prompt_snapshots: list[bytes] = field(default_factory=list)  # prompt-end and checkpoint snapshots it registered
    fork_rows: list[int] = field(default_factory=list)     # live rows reserved for forks not yet made (cache/forks.py)
    fork_blocks: list[int] = field(default_factory=list)   # blocks reserved for their copies of the partial last block
    images: tuple[ImageSpan, ...] = ()       # the prompt's image spans: blocks holding them key on them too
    hash_root: bytes | None = None           # the chain's root (its LoRA adapter's digest; cache/hashing.py)
