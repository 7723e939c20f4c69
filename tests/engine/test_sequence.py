import pytest

from qnext import SamplingParams
from qnext.engine.sequence import Sequence


def test_token_slice_equals_slicing_all_tokens():
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(), 0)
    seq.output_token_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_slice(start, end) == seq.token_ids[start:end]
    assert seq.num_remaining_tokens == 7


def test_token_view_reads_like_token_ids():
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(), 0)
    seq.output_token_ids = [5, 6, 7]
    view, tokens = seq.token_view, seq.token_ids
    assert len(view) == len(tokens)
    for start in range(-9, 9):
        for stop in range(-9, 9):
            assert view[start:stop] == tokens[start:stop]
    assert view[::2] == tokens[::2] and view[:] == tokens
    assert [view[i] for i in range(-7, 7)] == [tokens[i] for i in range(-7, 7)]
    seq.output_token_ids.append(8)                       # a view, not a copy
    assert len(view) == 8 and view[-1] == 8
    with pytest.raises(IndexError):
        view[8]
