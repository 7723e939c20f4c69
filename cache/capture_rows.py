"""Snapshot rows that a sequence's steps write captures into: at prefill capture positions, at decode block
boundaries, and the decode tracking row (an object the cache manager holds; docs/cache.md, "Call order"). A reserved
row is registered at the commit of the step that wrote it or at free (cache/snapshot_lifecycle.py), or released.
"""
from cache.config import CacheConfig
from cache.policy import CachePolicy
from cache.records import SequenceRecord
from cache.snapshot_lifecycle import SnapshotLifecycle


class CaptureRows:
    def __init__(self, config: CacheConfig, policy: CachePolicy, lifecycle: SnapshotLifecycle):
        self.config, self.policy, self.lifecycle = config, policy, lifecycle

    def reserve(self, seq: SequenceRecord, position: int) -> int | None:
        """The row the prefill step that ends exactly at `position` writes its state into (None: no capture)."""
        bs = self.config.block_size
        if position % bs or not seq.num_cached_tokens < position <= seq.prompt_len:
            raise ValueError(f"capture position {position} must be a multiple of {bs} in "
                             f"({seq.num_cached_tokens}, {seq.prompt_len}]")
        if position in seq.pending_captures:
            return seq.pending_captures[position]
        row = self.lifecycle.pool.reserve() if self.lifecycle.enabled else None
        if row is not None:
            seq.pending_captures[position] = row
        return row

    def decode_row(self, seq: SequenceRecord, position: int) -> int | None:
        """The row that holds (or is about to hold) the state after `position` decoded tokens: the tracking row,
        or a row of its own under a policy that keeps every decode snapshot. None: no capture here."""
        if position % self.config.block_size or position <= 0:
            raise ValueError(f"decode capture position {position} must be a positive multiple of "
                             f"{self.config.block_size}")
        if not self.policy.tracks_decode_boundary(position):
            return None
        if self.policy.keep_every_decode_snapshot:
            row = self.lifecycle.pool.reserve() if self.lifecycle.enabled else None
            if row is not None:
                seq.pending_captures[position] = row
            return row
        if self.tracking_row(seq) is not None:
            seq.decode_position = position
        return seq.decode_row

    def tracking_row(self, seq: SequenceRecord) -> int | None:
        """The row a decoding sequence's block-boundary states go to (reserved on first use), without moving its
        recorded position: a multi-step call writes it only in the step that reaches a boundary, which the host
        learns afterwards, and then records with `decode_row`. The row is held for the sequence's life, so
        reserving it never evicts a snapshot that earned protection (None: no tracking, try again later)."""
        if seq.decode_row is None and self.lifecycle.enabled:
            seq.decode_row = self.lifecycle.pool.reserve(may_evict_protected=False)
        return seq.decode_row
