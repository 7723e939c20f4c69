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
