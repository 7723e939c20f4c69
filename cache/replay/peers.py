"""Other engines' prefix-cache policies for hybrid models, as CachePolicy hooks (simplifications in brackets).

- kv-only: prefix caching of attention KV only (the default policy with no snapshot rows). Useless for a hybrid
  model: without the GDN state at the match point nothing can be skipped.
- disable-all (`DisableAllPolicy`): the approach the seed replaced (before vllm.rs PR #231): seed capture points,
  but the first KV eviction turns mamba prefix reuse off for the rest of the run.
- seed (`SeedPolicy`): vllm.rs as shipped (#348): KV inserted into the prefix cache only when a sequence ends;
  prefix-cache capacity 0.65 x KV blocks with trim on insert; snapshots at prefill-chunk ends (8192 tokens), at the
  prompt end and at every decode block boundary, each its own snapshot, usable once the sequence ended; two LRU
  classes (decode snapshots evicted before prefill ones); per-block invalidation on KV eviction. [Its misaligned
  prompt-end/finish snapshots are counted as if fixed (filed at the floor block with exactly that many tokens); a
  preempted sequence's KV is kept like a finished one's, which the seed drops.]
- sglang (`SGLangPolicy`): UnifiedRadixCache with extra_buffer: KV published at prefill end and at finish only up to
  the last decode track point (the KV beyond it is freed); one state per extend: the prefill end floored to the
  block, or the branch point instead when the KV match outran the state match; decode tracking every 256 tokens
  keeping only the latest, inserted at finish; states evicted by their own LRU (tombstones: KV kept), KV leaf
  eviction takes its state; a hit refreshes only the consumed state. [Block granularity = page = our block size;
  no HiCache; chunk ends at 8192 tokens also tracked. Its scheduler's in-batch prefix deprioritisation (a request
  sharing more than 32 tokens with one scheduled in the same round is deferred) is modelled as qnext's wait for a
  sibling, without the snapshot at the branch point: generous, since SGLang defers for that round only.]
- oracle (`OraclePolicy`): a snapshot at every block boundary of every prompt and decode; with unbounded memory
  and one request at a time it reuses the most any block-granular policy can on a request order.
"""
from cache.config import CacheConfig
from cache.policy import CachePolicy


class SeedPolicy(CachePolicy):
    sibling_wait_tokens = 0
    protect_snapshot_blocks = False
    promote_on_restore = False
    demote_superseded = False
    protect_continued = False
    keep_every_decode_snapshot = True
    chunk = 8192
    prefix_cache_ratio = 0.65

    def cached_block_limit(self, num_usable_blocks: int) -> int | None:
        return int(self.prefix_cache_ratio * num_usable_blocks)

    def capture_positions(self, config: CacheConfig, prompt_len: int, kv_matched_blocks: int,
                          restored_blocks: int, turn_starts=()) -> list[int]:
        bs = config.block_size
        return sorted({*range(self.chunk, prompt_len, self.chunk), prompt_len // bs * bs} - {0})

    def publish_limit(self, prompt_len: int, num_computed_tokens: int, tracked_position: int, freeing: bool) -> int:
        return num_computed_tokens if freeing else 0  # nothing is inserted while a sequence runs

    def snapshot_priority(self, position: int, prompt_len: int) -> int:
        return 1 if position <= prompt_len else 0  # "preserved" prefill snapshots outlive decode ones


class DisableAllPolicy(SeedPolicy):
    def __init__(self):
        self.disabled = False

    @property
    def snapshots_enabled(self) -> bool:
        return not self.disabled

    def on_kv_evicted(self, block_ids: list[int]) -> None:
        self.disabled = self.disabled or bool(block_ids)


class SGLangPolicy(CachePolicy):
    sibling_wait_tokens = 32        # IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
    capture_for_sibling = False
    protect_snapshot_blocks = False
    promote_on_restore = False      # one LRU; a hit refreshes only the consumed state
    demote_superseded = False
    protect_continued = False
    chunk = 8192
    track_interval = 256
    min_extend = 64                 # extends shorter than this track no state

    def capture_positions(self, config: CacheConfig, prompt_len: int, kv_matched_blocks: int,
                          restored_blocks: int, turn_starts=()) -> list[int]:
        bs = config.block_size
        if prompt_len - restored_blocks * bs < self.min_extend:
            return []
        last = kv_matched_blocks * bs if kv_matched_blocks > restored_blocks else prompt_len // bs * bs
        return sorted({*range(self.chunk, prompt_len, self.chunk), last} - {0})

    def tracks_decode_boundary(self, position: int) -> bool:
        return position % self.track_interval == 0

    def publish_limit(self, prompt_len: int, num_computed_tokens: int, tracked_position: int, freeing: bool) -> int:
        kept = max(prompt_len, tracked_position) if freeing else prompt_len  # decode steps insert nothing
        return min(num_computed_tokens, kept)


class OraclePolicy(SeedPolicy):
    protect_snapshot_blocks = True
    promote_on_restore = True

    def cached_block_limit(self, num_usable_blocks: int) -> int | None:
        return None

    def capture_positions(self, config: CacheConfig, prompt_len: int, kv_matched_blocks: int,
                          restored_blocks: int, turn_starts=()) -> list[int]:
        return list(range(config.block_size, prompt_len + 1, config.block_size))

    def publish_limit(self, prompt_len: int, num_computed_tokens: int, tracked_position: int, freeing: bool) -> int:
        return num_computed_tokens
