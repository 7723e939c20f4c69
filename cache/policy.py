"""What the prefix cache keeps and what it lets go first: qnext's policy, as hooks that a different policy overrides.

`CacheManager(config, policy)` owns every data structure and calls these hooks with plain values at the points
each docstring names; a hook never sees the manager. The defaults are qnext's policy (docs/cache.md). The trace
benchmark models other engines by overriding hooks (cache/replay/peers.py), so that every policy is replayed
through the same block pool, registry and snapshot pool.
"""
from collections.abc import Sequence

from cache.checkpoint_spacing import checkpoint_positions
from cache.config import CacheConfig


class CachePolicy:
    protect_snapshot_blocks = True       # KV leaves that end a snapshot's prefix are evicted after every other leaf
    promote_on_restore = True            # a restore moves the snapshot to the protected LRU segment (else: refresh)
    protected_share = 0.75               # cap of the protected segment, as a share of the snapshot rows
    demote_superseded = True             # at finish, what the sequence superseded and nobody used is evicted first
    protect_continued = True             # a finished turn that continued a previous turn's end starts protected
    keep_every_decode_snapshot = False   # False: one tracking row per sequence follows its latest decode boundary
    sibling_wait_tokens = 64             # hold a prompt back while an admitted one computes at least this much more
                                         # of its prefix than the cache serves (CacheManager.sibling_prefix); 0: off
    capture_for_sibling = True           # ... and that one captures a snapshot where the two prompts part

    @property
    def snapshots_enabled(self) -> bool:
        """Read at every admission, capture and registration; False turns snapshot reuse off."""
        return True

    def cached_block_limit(self, num_usable_blocks: int) -> int | None:
        """Most published KV blocks kept (publishing trims the LRU leaves beyond it); None: no limit. Read once."""
        return None

    def capture_positions(self, config: CacheConfig, prompt_len: int, kv_matched_blocks: int,
                          restored_blocks: int, turn_starts: Sequence[int] = ()) -> list[int]:
        """Where a new prompt captures snapshots (block multiples; the manager drops those at or below the restored
        depth and those already cached). qnext: the last block boundary the same prompt can reuse (<= prompt_len - 1),
        the prompt end if it is a boundary (a longer prompt extending this one), the branch point where the KV match
        outran the state match (siblings hit next time), checkpoints every `checkpoint_interval` tokens, at most
        MAX_CHECKPOINTS_PER_PROMPT of them (cache/checkpoint_spacing.py: the spacing doubles on longer prompts; requests
        that arrive before a branch point exists lose less), and the boundary at or before each of the
        last two turn starts (`<|im_start|>` of a chat prompt): the next turn re-renders the reply's header (the
        Qwen3.5 template drops the empty think block of earlier replies), and agents' side requests (Qwen Code's
        next-speaker check) resend the conversation with another final message."""
        bs = config.block_size
        interval = config.checkpoint_interval // bs * bs
        positions = {(prompt_len - 1) // bs * bs, *(s // bs * bs for s in turn_starts[-2:])}
        positions.update(checkpoint_positions(prompt_len, interval))
        if prompt_len % bs == 0:
            positions.add(prompt_len)
        if kv_matched_blocks > restored_blocks:
            positions.add(kv_matched_blocks * bs)
        return sorted(p for p in positions if p > 0)

    def tracks_decode_boundary(self, position: int) -> bool:
        """Whether decode_capture_row captures at this block boundary. The multi-step path (decode_tracking_row)
        writes the row at every boundary, so it needs a policy that tracks them all."""
        return True

    def publish_limit(self, prompt_len: int, num_computed_tokens: int, tracked_position: int, freeing: bool) -> int:
        """Tokens whose full KV blocks, and the snapshots at or below, are inserted into the cache now: at a commit
        (freeing=False) or at free. tracked_position: the sequence's recorded decode boundary (0: none). qnext
        inserts everything computed, after every step."""
        return num_computed_tokens

    def snapshot_priority(self, position: int, prompt_len: int) -> int:
        """LRU segment a new snapshot starts in: 0 probation (qnext: until its first hit), 1 protected."""
        return 0

    def on_kv_evicted(self, block_ids: list[int]) -> None:
        """Told of every KV eviction (after the snapshots tied to those blocks were dropped)."""
