"""State carried across steps: prefill, decode through state rows and paged KV, snapshot capture and restore,
and mixed decode + prefill steps give the full-prompt logits."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import qnext  # noqa: E402
from qnext.model.cache_layout import model_cache_buffers  # noqa: E402
from qnext.model.step_inputs import LayoutSizes, Segment, build_step_inputs  # noqa: E402
from tests.support.hf_reference import build_hf_model, save_hf_model  # noqa: E402

BS, CHUNK = 16, 16
SIZES = LayoutSizes(num_tokens=32, num_decode=2, num_chunks=4, max_blocks=4, num_logits=32)
LIVE_A, LIVE_B, SNAP = 1, 2, 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = build_hf_model("qwen3_next", seed=5)
    return qnext.load_model(save_hf_model(hf, tmp_path_factory.mktemp("ckpt")))


def test_prefill_decode_capture_restore_and_mixed_steps(model):
    cfg = model.config
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 40).tolist()
    full = model.logits(ids)
    buffers = model_cache_buffers(cfg, num_blocks=8, block_size=BS, num_state_rows=5, dtype=model.dtype)

    def run(segments, buffers):
        inputs = build_step_inputs(segments, SIZES, block_size=BS, chunk=CHUNK)
        logits, buffers = model._step(model.params, buffers, inputs)
        return np.asarray(logits), buffers

    # Sequence A: prefill 20 tokens (two groups, cut at the capture position 16), then decode 4 tokens.
    table_a = [1, 2, 3]
    seg = Segment(ids[:20], 0, table_a, read_row=-1, write_row=LIVE_A, captures={16: SNAP}, all_logits=True)
    logits, buffers = run([seg], buffers)
    np.testing.assert_allclose(logits[:20], full[:20], atol=1e-4)
    for pos in range(20, 23):
        logits, buffers = run([Segment([ids[pos]], pos, table_a, LIVE_A, LIVE_A)], buffers)
        np.testing.assert_allclose(logits[0], full[pos], atol=1e-4)

    # Sequence B restores the snapshot after 16 tokens (sharing A's first block) while A decodes in the same step.
    table_b = [1, 4, 5]
    seg_b = Segment(ids[16:36], 16, table_b, read_row=SNAP, write_row=LIVE_B, all_logits=True)
    seg_a = Segment([ids[23]], 23, table_a, LIVE_A, LIVE_A)
    logits, buffers = run([seg_a, seg_b], buffers)
    np.testing.assert_allclose(logits[0], full[23], atol=1e-4)
    np.testing.assert_allclose(logits[1:21], full[16:36], atol=1e-4)
    # B continues by decode from its live row.
    logits, buffers = run([Segment([ids[36]], 36, table_b, LIVE_B, LIVE_B)], buffers)
    np.testing.assert_allclose(logits[0], full[36], atol=1e-4)


def test_scoring_rejects_bad_token_ids(model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.logits([1, model.config.vocab_size])
    with pytest.raises(ValueError, match="empty"):
        model.logits([])
