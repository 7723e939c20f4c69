"""Where a long prompt places its checkpoint snapshots (pure, no jax).

Every `interval` tokens while the prompt is at most `max_checkpoints` intervals long; past that the spacing doubles
(2, 4, 8 ... intervals) so that a prompt never places more than `max_checkpoints`, whatever its length: at the
default 1k interval an 8k prompt places one every 1k, a 64k prompt every 8k, a 256k prompt every 32k (8, where a
fixed 8k interval placed 32), a 1M prompt every 128k. The fine spacing of shorter prompts is what a request needs
that arrives while another with the same prefix is still in prefill: its KV match reaches the other's last step,
and a checkpoint at most 1k behind it lets it resume there instead of recomputing the whole match. Spacings are
power-of-two multiples of the interval, so a longer prompt's checkpoints are a subset of a shorter prompt's grid:
two prompts that share a prefix still meet at the coarser grid's positions inside it.
"""

MAX_CHECKPOINTS_PER_PROMPT = 8


def checkpoint_positions(prompt_len: int, interval: int,
                         max_checkpoints: int = MAX_CHECKPOINTS_PER_PROMPT) -> list[int]:
    """Positions in (0, prompt_len) at the spacing above; interval 0: none. `interval` is a multiple of the block
    size (the caller floors it), so the positions are block boundaries."""
    if interval <= 0 or max_checkpoints <= 0:
        return []
    spacing = interval
    while (prompt_len - 1) // spacing > max_checkpoints:
        spacing *= 2
    return list(range(spacing, prompt_len, spacing))
