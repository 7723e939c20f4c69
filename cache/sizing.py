"""How many snapshot rows fit: the configured maximum bounded by a byte budget."""
import logging

logger = logging.getLogger("qnext.cache")


def snapshot_budget_bytes(budget: int | float, device_memory_bytes: int | None = None) -> int:
    """A byte budget given as bytes (int) or as a fraction in (0, 1] of device memory (float)."""
    if isinstance(budget, float):
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"snapshot budget fraction {budget} must be in [0, 1]; pass an int for bytes")
        if device_memory_bytes is None:
            raise ValueError("a fractional snapshot budget needs device_memory_bytes")
        return int(budget * device_memory_bytes)
    if budget < 0:
        raise ValueError(f"snapshot budget {budget} bytes must be >= 0")
    return int(budget)


def snapshot_pool_capacity(requested: int, bytes_per_snapshot: int, budget_bytes: int) -> int:
    """min(requested, budget_bytes // bytes_per_snapshot); logs one line naming both numbers when the budget caps
    it. 0 disables snapshot reuse."""
    if requested < 0 or bytes_per_snapshot <= 0 or budget_bytes < 0:
        raise ValueError(f"requested={requested} snapshots, {bytes_per_snapshot} bytes each, budget {budget_bytes} "
                         "bytes: need requested >= 0, bytes_per_snapshot > 0, budget >= 0")
    fits = budget_bytes // bytes_per_snapshot
    if fits >= requested:
        return requested
    logger.warning("mamba snapshot pool capped from %d to %d snapshots: budget %d bytes / %d bytes per snapshot%s",
                   requested, fits, budget_bytes, bytes_per_snapshot,
                   "; prefix reuse for hybrid layers is off" if fits == 0 else "")
    return fits
