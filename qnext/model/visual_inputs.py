"""Image and video inputs of one step: StepInputs with the MRoPE positions and the tower's embeddings laid out
over the flat batch (StepInputs' rope_positions, visual_embeds, visual_token_index)."""
from __future__ import annotations

import numpy as np

from qnext.model.step_inputs import StepInputs


def with_visual_inputs(inputs: StepInputs, rope_positions=None, visual_embeds=None, visual_token_index=None,
                       num_visual_rows: int | None = None) -> StepInputs:
    """rope_positions: [3, n] for the first n flat tokens (the rest, padding included, keep their token positions
    on all three axes); visual_embeds [N, H] placed at flat tokens visual_token_index [N]. num_visual_rows pads N
    (a shape bucket: one compilation for every N up to it); padding rows are dropped."""
    t = inputs.token_ids.shape[0]
    rope = None
    if rope_positions is not None:
        given = np.asarray(rope_positions, np.int32)
        if given.ndim != 2 or given.shape[0] != 3 or given.shape[1] > t:
            raise ValueError(f"rope_positions must be [3, n] with n <= {t} flat tokens; got {given.shape}")
        rope = np.broadcast_to(np.asarray(inputs.positions, np.int32), (3, t)).copy()
        rope[:, :given.shape[1]] = given
    embeds = index = None
    if visual_embeds is not None:
        index = np.asarray(visual_token_index, np.int32).reshape(-1)
        n = index.shape[0]
        if visual_embeds.shape[0] != n:
            raise ValueError(f"{visual_embeds.shape[0]} visual embeddings for {n} visual tokens")
        rows = n if num_visual_rows is None else num_visual_rows
        if rows < n:
            raise ValueError(f"num_visual_rows {rows} is smaller than the {n} visual tokens")
        index = np.concatenate([index, np.full(rows - n, t, np.int32)])
        embeds = visual_embeds
        if rows > n:
            import jax.numpy as jnp

            embeds = jnp.concatenate([jnp.asarray(visual_embeds),
                                      jnp.zeros((rows - n, visual_embeds.shape[1]), visual_embeds.dtype)])
    return inputs.replace(rope_positions=rope, visual_embeds=embeds, visual_token_index=index)
