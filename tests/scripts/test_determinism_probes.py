"""The facts docs/determinism.md builds its plan on, as measured today on XLA:CPU: a delta-rule pass cut at a chunk
boundary is bit for bit the one-pass result while a cut elsewhere or another chunk size is not; the log-softmax of
a row does not depend on the rows beside it. (Either can change with XLA: then the doc and the plan change.)"""
from __future__ import annotations

from scripts.determinism_probes import main


def test_delta_rule_is_exact_only_across_chunk_aligned_cuts_and_log_softmax_is_row_invariant():
    lines = main(["--only", "delta", "softmax"])
    found = dict((line.rsplit(": ", 1)[0], line.rsplit(": ", 1)[1]) for line in lines if "differ" not in line)
    assert any("cut at 64 (a chunk boundary)" in k for k in found), lines
    assert any("row 0 of a batch of 8 vs batch of 1, chunk 64" in k for k in found), lines
    assert any("log_softmax: row 0 of 8 rows vs 1 row" in k for k in found), lines
    differing = [line for line in lines if "differ" in line]
    assert any("cut at 40" in line for line in differing), lines
    assert any("chunk 32 vs chunk 64" in line for line in differing), lines
    assert any("token-by-token recurrence" in line for line in differing), lines
