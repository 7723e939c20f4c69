"""window_inputs lays a MultiStepPlan out one way for both window steps (multi-step and speculative): each row's
budget, the snapshot row at the window position whose state completes a block, its stop ids, its drafts; the rest
of the bucket's rows are padding that keeps nothing."""
from __future__ import annotations

import numpy as np

from qnext.engine.plan import MultiStepPlan
from qnext.engine.window import window_inputs


def test_rows_are_laid_out_and_the_rest_is_padding():
    plan = MultiStepPlan(steps=[3, 1], captures=[{1: 9}, {}], stop_ids=[[2], [2, 5, 6, 7, 8]])
    window = window_inputs(plan, [[11, 12, 13], [21, 22, 23]], rows=4, width=4)
    np.testing.assert_array_equal(window.steps, [3, 1, 0, 0])
    np.testing.assert_array_equal(window.capture_row, [[0, 9, 0, 0], [0] * 4, [0] * 4, [0] * 4])
    assert window.stop_ids.shape == (4, 8)                      # a power of two that holds the longest list
    np.testing.assert_array_equal(window.stop_ids[1], [2, 5, 6, 7, 8, -1, -1, -1])
    np.testing.assert_array_equal(window.stop_ids[0], [2] + [-1] * 7)
    assert (window.stop_ids[2:] == -1).all()
    np.testing.assert_array_equal(window.drafts, [[11, 12, 13], [21, 22, 23], [0] * 3, [0] * 3])


def test_a_multi_step_window_has_no_drafts():
    plan = MultiStepPlan(steps=[4], captures=[{3: 5}], stop_ids=[[]])
    window = window_inputs(plan, None, rows=2, width=4)
    np.testing.assert_array_equal(window.capture_row, [[0, 0, 0, 5], [0] * 4])
    assert window.stop_ids.shape == (2, 4) and (window.stop_ids == -1).all()
    assert (window.drafts == 0).all() and window.drafts.shape == (2, 3)
