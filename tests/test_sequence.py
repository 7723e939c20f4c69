from qnext import SamplingParams
from qnext.engine.sequence import Sequence


def test_token_slice_equals_slicing_all_tokens():
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(), 0)
    seq.output_token_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_slice(start, end) == seq.token_ids[start:end]
    assert seq.num_remaining_tokens == 7
