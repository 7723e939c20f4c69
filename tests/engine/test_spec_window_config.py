"""How many drafts a verify window takes: up to 15 (suffix and n-gram windows are longer than the MTP head's),
bounded by one KV block."""
import pytest

from qnext.engine.config import EngineConfig


def test_windows_past_eight_tokens_are_accepted_within_a_block():
    assert EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 8}).num_speculative_tokens == 8
    assert EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 15}).num_speculative_tokens == 15


@pytest.mark.parametrize("k, options, message", [(16, {}, "num_speculative_tokens"),
                                                 (8, {"block_size": 8}, "must fit one KV block")])
def test_windows_too_long_are_refused_saying_why(k, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": k}, **options)


def test_cpu_windows_pad_to_row_groups_the_gemm_runs_fast():
    from qnext.engine.spec_step import window_length

    # one row: 2 and 4 positions as they are, 5 -> 8, 9 -> 16 tokens
    assert [window_length(k, "cpu") for k in (1, 3, 4, 7, 8)] == [2, 4, 8, 8, 16]
    # many rows: the step's rows x positions a multiple of 8
    assert window_length(3, "cpu", 16) == 4 and window_length(2, "cpu", 4) == 4 and window_length(2, "cpu", 8) == 3
    assert window_length(8, "gpu") == 16 and window_length(2, "gpu") == 4
