"""The step's image / video inputs: laid out over the flat batch, and absent from text-only steps (which trace
without the embedding scatter and with the plain rope)."""
from __future__ import annotations

from collections import Counter

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.model.cache_layout import model_cache_buffers
from qnext.model.checkpoint import load_checkpoint
from qnext.model.forward import forward
from qnext.model.step_inputs import LayoutSizes, Segment, build_step_inputs
from qnext.model.visual_inputs import with_visual_inputs

SIZES = LayoutSizes(num_tokens=16, num_decode=0, num_chunks=2, max_blocks=4, num_logits=16)


def text_inputs(n=10):
    seg = Segment(list(range(3, 3 + n)), 0, [1, 2, 3], -1, 1, all_logits=True)
    return build_step_inputs([seg], SIZES, block_size=4, chunk=8)


def test_visual_inputs_fill_the_flat_batch():
    inputs = text_inputs()
    given = np.arange(30, dtype=np.int32).reshape(3, 10)
    out = with_visual_inputs(inputs, given, np.ones((3, 8), np.float32), [4, 5, 6], num_visual_rows=5)
    np.testing.assert_array_equal(out.rope_positions[:, :10], given)
    np.testing.assert_array_equal(out.rope_positions[:, 10:], np.broadcast_to(inputs.positions[10:], (3, 6)))
    np.testing.assert_array_equal(out.visual_token_index, [4, 5, 6, 16, 16])         # padding: out of range
    assert out.visual_embeds.shape == (5, 8)
    with pytest.raises(ValueError, match="2 visual tokens"):
        with_visual_inputs(inputs, None, np.ones((3, 8), np.float32), [4, 5])
    with pytest.raises(ValueError, match="smaller than the 3 visual tokens"):
        with_visual_inputs(inputs, None, np.ones((3, 8), np.float32), [4, 5, 6], num_visual_rows=2)


def primitives(jaxpr) -> Counter:
    counts = Counter()
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            counts += primitives(sub)
    return counts


def test_text_only_steps_trace_without_the_vision_work(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint("qwen3_5", vlm=True))
    buffers = model_cache_buffers(ckpt.config, num_blocks=5, block_size=4, num_state_rows=2, dtype=np.float32)
    trace = lambda inputs: jax.make_jaxpr(lambda p, b, i: forward(p, b, i, ckpt.config))(   # noqa: E731
        ckpt.params, buffers, inputs).jaxpr
    text = trace(text_inputs())
    embeds = jnp.ones((3, ckpt.config.hidden_size), jnp.float32)
    visual = trace(with_visual_inputs(text_inputs(), np.zeros((3, 10), np.int32), embeds, [4, 5, 6]))
    text_ops, visual_ops = primitives(text), primitives(visual)
    assert visual_ops["scatter"] == text_ops["scatter"] + 1                    # the embeddings' placement
    assert text_ops["cos"] == visual_ops["cos"]                                # rope in both, one axis mix more
    assert sum(text_ops.values()) < sum(visual_ops.values())
