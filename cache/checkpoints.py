"""Where a long prompt places its checkpoint snapshots (pure, no jax).

Every `interval` tokens while the prompt is at most `max_checkpoints` intervals long; past that the spacing doubles
(2, 4, 8 ... intervals) so that a prompt never places more than `max_checkpoints`, whatever its length: a 256k-token
prompt at the default 8k interval places 8 (every 32k), not 32. Spacings are power-of-two multiples of the interval,
so a longer prompt's checkpoints are a subset of a shorter prompt's grid: two prompts that share a prefix still meet
at the coarser grid's positions inside it.
"""

MAX_CHECKPOINTS_PER_PROMPT = 8


def checkpoint_positions(prompt_len: int, interval: int, max_checkpoints: int = MAX_CHECKPOINTS_PER_PROMPT) -> list[int]:
    """Positions in (0, prompt_len) at the spacing above; interval 0: none. `interval` is a multiple of the block
    size (the caller floors it), so the positions are block boundaries."""
    if interval <= 0 or max_checkpoints <= 0:
        return []
    spacing = interval
    while (prompt_len - 1) // spacing > max_checkpoints:
        spacing *= 2
    return list(range(spacing, prompt_len, spacing))
