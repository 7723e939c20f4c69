"""The tower's attention bounds its memory on large frames: query chunks give the whole frame's result (the tower's
parity with transformers: tests/model/test_vision_vs_transformers.py)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def test_tower_attention_in_query_chunks_equals_whole():
    from qnext.vision.tower import _frame_attention, query_chunk

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 300, 2, 8)), jnp.float32) for _ in range(3))
    np.testing.assert_allclose(np.asarray(_frame_attention(q, k, v, chunk=64)),
                               np.asarray(_frame_attention(q, k, v, chunk=300)), atol=1e-6)
    assert query_chunk(1, 300, 2) == 300
    assert query_chunk(1, 47628, 16) == 256                        # a 3024 x 4032 photo at Qwen3.5's 16 heads
