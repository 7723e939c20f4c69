"""The per-row tables of a multi-token window step: several tokens per decoding row in one jitted call, either
num_scheduler_steps decode steps (multi_step.py) or a speculative step's verify window of k + 1 tokens (spec_step.py).
The scheduler's MultiStepPlan says, per row, how many tokens it may keep, which window position's state completes a
block (and the snapshot row that takes it) and which token ids stop it; `window_inputs` lays that out for the
device, one way for both kinds."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct

from qnext.engine.plan import MultiStepPlan


@struct.dataclass
class WindowInputs:
    """Per row of a window step over D rows and a window of W positions."""

    steps: jnp.ndarray        # [D] int32 tokens the row may keep (0: padding row)
    capture_row: jnp.ndarray  # [D, W] int32 snapshot row for the state after window position j (0: none)
    stop_ids: jnp.ndarray     # [D, S] int32 token ids that end the row (-1: unused)
    drafts: jnp.ndarray       # [D, W - 1] int32 a speculative step's drafts (window positions 1..); else zeros
    # [D, W, ceil(V / 32)] int32 a verify window's grammar masks: bit t of row i, position j set = token t allowed
    # there (structured/matcher.fill_window_bitmask); None: no row is constrained
    token_bitmask: jnp.ndarray | None = None

    @classmethod
    def padding(cls, rows: int, width: int, stop_width: int = 4) -> "WindowInputs":
        """Host arrays for `rows` padding rows (nothing kept, no capture, no stop ids), to fill in place."""
        return cls(steps=np.zeros(rows, np.int32), capture_row=np.zeros((rows, width), np.int32),
                   stop_ids=np.full((rows, stop_width), -1, np.int32),
                   drafts=np.zeros((rows, width - 1), np.int32))


def window_inputs(multi: MultiStepPlan, drafts: list[list[int]] | None, rows: int, width: int) -> WindowInputs:
    """The plan's rows laid out over `rows` device rows (the rest padding), drafts None for a multi-step call."""
    window = WindowInputs.padding(rows, width, stop_id_width(multi.stop_ids))
    window.steps[:len(multi.steps)] = multi.steps
    for i, (captures, ids) in enumerate(zip(multi.captures, multi.stop_ids)):
        for position, row in captures.items():
            window.capture_row[i, position] = row
        window.stop_ids[i, :len(ids)] = ids
    if drafts is not None:
        window.drafts[:len(drafts)] = drafts
    return window


def stop_id_width(stop_ids: list[list[int]]) -> int:
    """Columns of a call's stop-id table: a power of two from 4 (a few widths, each one compilation)."""
    width = 4
    while width < max(len(ids) for ids in stop_ids):
        width *= 2
    return width
