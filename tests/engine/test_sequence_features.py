"""Per-request features (qnext/engine/sequence_features.py): the scheduler calls a sequence's feature objects at
fixed points instead of testing a field per feature. A feature may end a request after a sampled token, releases
what it holds when its request is aborted while waiting, and PD's export is one of them (engine/pd_features.py)."""
from __future__ import annotations

import pytest

from qnext import SamplingParams
from qnext.engine.llm_engine import LLMEngine
from qnext.engine.pd_features import ExportPrefillFeature
from qnext.engine.sequence import Sequence
from qnext.engine.sequence_features import SequenceFeature

ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=96, block_size=16,
              num_gpu_blocks_override=24, max_num_snapshots=4)
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


class StopAfter(SequenceFeature):
    """Ends its request once it has `n` tokens; counts the hooks called."""

    def __init__(self, n: int):
        self.n, self.sampled, self.dropped_ids = n, [], []

    def after_sample(self, seq, token, manager):
        self.sampled.append(token.token_id)
        return ("stop", "enough") if len(seq.output_token_ids) >= self.n else None

    def dropped(self, manager, seq):
        self.dropped_ids.append(seq.request_id)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine(tiny_checkpoint("qwen3_5"), **ENGINE)


def run(engine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    return outs


def test_a_feature_ends_its_request_after_a_sampled_token_and_the_others_run_on(engine):
    engine.add_request("plain", {"prompt_token_ids": list(range(3, 23))}, SamplingParams(**GREEDY))
    engine.add_request("short", {"prompt_token_ids": list(range(3, 23))}, SamplingParams(**GREEDY))
    feature = StopAfter(2)
    engine.requests["short"].features.append(feature)
    outs = run(engine)
    short, plain = outs["short"].outputs[0], outs["plain"].outputs[0]
    assert short.finish_reason == "stop" and short.stop_reason == "enough" and len(short.token_ids) == 2
    assert feature.sampled == short.token_ids                  # called once per sampled token, with that token
    assert plain.finish_reason == "length" and plain.token_ids[:2] == short.token_ids
    engine.release("short")
    engine.release("plain")


def test_a_request_aborted_while_waiting_lets_its_features_release_what_they_hold(engine):
    engine.add_request("w", {"prompt_token_ids": list(range(3, 23))}, SamplingParams(**GREEDY))
    feature = StopAfter(1)
    seq: Sequence = engine.requests["w"]
    seq.features.append(feature)
    engine.abort_request("w")
    assert feature.dropped_ids == ["w"] and seq.features == [] and seq.finish_reason == "abort"
    engine.release("w")


def test_a_prefill_request_is_a_feature_not_a_flag(engine):
    engine.pd.add_prefill_request("p", {"prompt_token_ids": list(range(3, 23))}, SamplingParams(**GREEDY))
    seq = engine.requests["p"]
    assert [type(f) for f in seq.features] == [ExportPrefillFeature]
    assert not hasattr(seq, "export_prefill") and not hasattr(seq, "transferred")
    out = run(engine)["p"].outputs[0]
    assert out.finish_reason == "prefilled" and len(out.token_ids) == 1
    bundle = engine.pd.take_prefill_bundle("p")
    assert bundle is not None and bundle.meta["prompt_token_ids"] == list(range(3, 23))
    engine.release("p")
