import pytest

from qnext.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs) == (16, 0, False, None)
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy and not p.uses_penalties and not p.uses_top_k_top_p


def test_normalises_stop_and_flags():
    p = SamplingParams(stop="###", stop_token_ids=(7,), temperature=0.0, top_k=5, repetition_penalty=1.1)
    assert p.stop == ["###"] and p.stop_token_ids == [7]
    assert p.greedy and p.uses_penalties
    assert not p.uses_top_k_top_p  # greedy ignores filtering
    assert SamplingParams(top_k=-1).top_k == -1 and not SamplingParams(top_k=-1).uses_top_k_top_p
    assert SamplingParams(top_p=0.9).uses_top_k_top_p
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("name, value", [
    ("n", 0), ("n", 1.5), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.5), ("seed", "abc"), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("stop", [""]), ("stop", ["ok", 3]), ("stop_token_ids", [-1]),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("logprobs", True),
])
def test_invalid_value_names_parameter_and_value(name, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{name: value})
    message = str(err.value)
    assert message.startswith(name) and repr(value) in message


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)
