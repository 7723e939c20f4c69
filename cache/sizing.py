"""One byte budget for the whole cache, split between KV blocks, live state rows and snapshot rows (pure, no jax).

Split rule (`plan_cache`):
1. The zero state row and `max_num_seqs` live state rows come first: every running sequence needs one (and, with a
   narrow snapshot pool, `num_staging_rows` float32 rows the step stages mid-sequence captures in).
2. Of the rest, snapshot rows may take `snapshot_memory_fraction`, further capped by `snapshot_memory_bytes` and
   `max_num_snapshots`, and never so much that the KV blocks could not hold one sequence of max_model_len. The
   pool is sized in bytes: with no `max_num_snapshots` the row count follows from the bytes, bounded only by the
   rows the KV can anchor, one per `SNAPSHOT_SPACING_TOKENS` of KV (a snapshot is usable only while its terminal KV
   block is resident, so rows beyond that never serve; the bound binds only where a row costs less than about
   that many tokens of KV, as on tiny models; a real model's row costs thousands of tokens of KV).
3. Everything left is KV blocks.
The dummy KV block 0 and the zero state row 0 are counted: kv_bytes + state_bytes is what the buffers allocate.
A snapshot row costs `snapshot_bytes_per_row` (the narrow pool's bytes with mamba_ssm_cache_dtype bfloat16: about
half of a float32 live row, so about twice the rows at the same bytes); a live row `state_bytes_per_row`.
"""
from dataclasses import dataclass


# Share of the memory after the live rows that snapshot rows may take; the trace benchmark's sweep
# (scripts/bench_prefix_cache.py, "snapshot share" table) supports this default.
DEFAULT_SNAPSHOT_MEMORY_FRACTION = 0.75
GIB = 1 << 30
# Fewest KV tokens per snapshot row when the bytes alone size the pool: the placement policy keeps a few reuse
# points per turn (turn starts, the prompt's last boundary, the branch point, the finished sequence's end), and a
# turn of an agent session is a few hundred tokens.
SNAPSHOT_SPACING_TOKENS = 128


@dataclass(frozen=True)
class CacheSizes:
    num_blocks: int          # usable KV blocks; the dummy block 0 comes on top
    block_size: int
    num_live_rows: int       # = max_num_seqs
    num_snapshot_rows: int
    kv_bytes: int            # (num_blocks + 1) blocks, dummy included
    state_bytes: int         # (1 + num_live_rows + num_staging_rows) live-width rows + the snapshot rows
    budget_bytes: int
    max_num_snapshots: int | None = None   # the configured cap, to say when the budget cut it
    num_staging_rows: int = 0              # float32 rows of a narrow snapshot pool's step (0: no separate pool)
    snapshot_row_bytes: int | None = None  # a snapshot row's bytes (None: a live row's)

    def as_dict(self) -> dict:
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "kv_bytes": self.kv_bytes,
                "num_live_rows": self.num_live_rows, "num_snapshot_rows": self.num_snapshot_rows,
                "num_staging_rows": self.num_staging_rows, "state_bytes": self.state_bytes,
                "budget_bytes": self.budget_bytes}

    @property
    def live_row_bytes(self) -> int:
        """A live (float32) state row's bytes."""
        live_rows = 1 + self.num_live_rows + self.num_staging_rows
        if self.snapshot_row_bytes is None:            # one buffer: every row the same
            return self.state_bytes // (live_rows + self.num_snapshot_rows)
        return (self.state_bytes - self.num_snapshot_rows * self.snapshot_row_bytes) // live_rows

    def describe(self) -> str:
        """One start-up log line: what each part holds and costs."""
        row_bytes = self.live_row_bytes
        live_bytes = (1 + self.num_live_rows + self.num_staging_rows) * row_bytes
        snapshot_bytes = self.num_snapshot_rows * (self.snapshot_row_bytes or row_bytes)
        staging = f" and {self.num_staging_rows} staging rows" if self.num_staging_rows else ""
        return (f"cache {_gib(self.kv_bytes + self.state_bytes)} of {_gib(self.budget_bytes)}: "
                f"{self.num_blocks} KV blocks = {self.num_blocks * self.block_size} tokens ({_gib(self.kv_bytes)}), "
                f"{self.num_live_rows} live state rows ({_gib(live_bytes)} with the zero row{staging}), "
                f"{self.num_snapshot_rows} snapshot rows ({_gib(snapshot_bytes)})"
                + (f"; max_num_snapshots {self.max_num_snapshots} cut to {self.num_snapshot_rows} by the budget"
                   if self.max_num_snapshots is not None and self.num_snapshot_rows < self.max_num_snapshots else ""))


def plan_cache(budget_bytes: int, *, kv_bytes_per_block: int, state_bytes_per_row: int, block_size: int,
               max_num_seqs: int, max_model_len: int,
               snapshot_memory_fraction: float = DEFAULT_SNAPSHOT_MEMORY_FRACTION,
               max_num_snapshots: int | None = None, snapshot_memory_bytes: int | None = None,
               snapshot_bytes_per_row: int | None = None, num_staging_rows: int = 0) -> CacheSizes:
    """Split `budget_bytes` by the module's rule. state_bytes_per_row = 0 (no linear-attention layers): no
    snapshot rows. snapshot_bytes_per_row: a snapshot row's bytes (None: state_bytes_per_row, one buffer).
    Raises ValueError when the budget cannot hold one sequence of max_model_len plus the state rows."""
    if kv_bytes_per_block <= 0 or state_bytes_per_row < 0 or block_size <= 0 or max_num_seqs < 1 or max_model_len < 1:
        raise ValueError(f"kv_bytes_per_block={kv_bytes_per_block}, state_bytes_per_row={state_bytes_per_row}, "
                         f"block_size={block_size}, max_num_seqs={max_num_seqs}, max_model_len={max_model_len}: "
                         "need kv_bytes_per_block, block_size, max_num_seqs, max_model_len > 0 and state bytes >= 0")
    if not 0.0 <= snapshot_memory_fraction <= 1.0:
        raise ValueError(f"snapshot_memory_fraction={snapshot_memory_fraction} must be in [0, 1]")
    for name, cap in (("max_num_snapshots", max_num_snapshots), ("snapshot_memory_bytes", snapshot_memory_bytes)):
        if cap is not None and cap < 0:
            raise ValueError(f"{name}={cap} must be >= 0 (None: no cap)")
    live_bytes = (1 + max_num_seqs + num_staging_rows) * state_bytes_per_row
    snapshot_row = state_bytes_per_row if snapshot_bytes_per_row is None else snapshot_bytes_per_row
    min_kv_bytes = (1 + -(-max_model_len // block_size)) * kv_bytes_per_block
    if budget_bytes < live_bytes + min_kv_bytes:
        raise ValueError(f"cache budget {budget_bytes} bytes cannot hold one sequence of max_model_len "
                         f"{max_model_len}: its {-(-max_model_len // block_size)} KV blocks (+ the dummy) take "
                         f"{min_kv_bytes} bytes and the zero + {max_num_seqs} live state rows {live_bytes} bytes, "
                         f"{live_bytes + min_kv_bytes} in all; raise the budget or lower max_model_len / max_num_seqs")
    shared = budget_bytes - live_bytes
    num_snapshot_rows = 0
    if state_bytes_per_row:
        snapshot_bytes = min(int(snapshot_memory_fraction * shared), shared - min_kv_bytes)
        if snapshot_memory_bytes is not None:
            snapshot_bytes = min(snapshot_bytes, snapshot_memory_bytes)
        num_snapshot_rows = snapshot_bytes // snapshot_row
        if max_num_snapshots is not None:
            num_snapshot_rows = min(num_snapshot_rows, max_num_snapshots)
        else:                              # one row per SNAPSHOT_SPACING_TOKENS of the KV that the rest holds
            unit = snapshot_row + kv_bytes_per_block * SNAPSHOT_SPACING_TOKENS / block_size
            num_snapshot_rows = min(num_snapshot_rows, int(shared // unit))
    state_bytes = live_bytes + num_snapshot_rows * snapshot_row
    num_blocks = (budget_bytes - state_bytes) // kv_bytes_per_block - 1
    return CacheSizes(num_blocks=num_blocks, block_size=block_size, num_live_rows=max_num_seqs,
                      num_snapshot_rows=num_snapshot_rows, kv_bytes=(num_blocks + 1) * kv_bytes_per_block,
                      state_bytes=state_bytes, budget_bytes=budget_bytes, max_num_snapshots=max_num_snapshots,
                      num_staging_rows=num_staging_rows, snapshot_row_bytes=snapshot_bytes_per_row)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
