"""Comparing parameter pytrees in tests."""
from __future__ import annotations

import numpy as np


def assert_same_tree(a, b):
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        np.testing.assert_array_equal(np.asarray(flat_a[k]), np.asarray(flat_b[k]), err_msg=str(k))


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in _flatten(v, prefix + (k,)).items()}
    if isinstance(tree, tuple):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in _flatten(v, prefix + (i,)).items()}
    return {prefix: tree}
