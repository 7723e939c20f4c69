"""What rank 0 broadcasts to the other ranks (qnext/distributed/request_codec.py): plain data in a fixed schema,
never pickle. Every op round-trips exactly (sampling params, token ids, a picture's pixels bit for bit); bytes
outside the schema are refused with a ValueError naming the problem, and nothing in them is ever executed."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from qnext.distributed.request_codec import decode_ops, encode_ops
from qnext.sampling_params import SamplingParams
from qnext.vision.preprocess import VisualInput


def picture() -> VisualInput:
    pixels = np.random.default_rng(0).standard_normal((16, 12)).astype(np.float32)
    return VisualInput("image", pixels, (1, 4, 4), 4)


def test_every_op_round_trips():
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, stop=["\n\n"], max_tokens=5, logprobs=2,
                            structured_outputs={"json": {"type": "object"}})
    ops = [("add", "r1", {"prompt": "hi", "prompt_token_ids": [1, 2, 3],
                          "multi_modal_data": {"image": [picture()]}}, params),
           ("add", "r2", "plain text", None), ("add", "r3", [5, 6], SamplingParams()),
           ("abort", "r1"), ("release", "r1"), ("shutdown",)]
    decoded = decode_ops(encode_ops(ops))
    assert [op[0] for op in decoded] == ["add", "add", "add", "abort", "release", "shutdown"]
    _, rid, prompt, got = decoded[0]
    assert rid == "r1" and got == params
    assert prompt["prompt"] == "hi" and prompt["prompt_token_ids"] == [1, 2, 3]
    sent, received = picture(), prompt["multi_modal_data"]["image"][0]
    assert received.pixel_values.dtype == np.float32
    assert received.pixel_values.tobytes() == sent.pixel_values.tobytes()
    assert (received.kind, received.grid_thw, received.num_tokens, received.content_hash) == \
        (sent.kind, sent.grid_thw, sent.num_tokens, sent.content_hash)
    assert decoded[1:3] == [("add", "r2", "plain text", None), ("add", "r3", [5, 6], SamplingParams())]
    assert decode_ops(encode_ops([])) == []


def test_a_pickle_is_refused_and_never_loaded():
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("a follower unpickled what came over the collective",))

    data = pickle.dumps([("add", "r", Boom(), None)])
    with pytest.raises(ValueError, match="request broadcast"):
        decode_ops(len(data).to_bytes(8, "big") + data)
    with pytest.raises(ValueError, match="header"):
        decode_ops(data)


def header(ops: list, arrays: list = ()) -> bytes:
    text = json.dumps({"version": 1, "ops": ops, "arrays": list(arrays)}).encode()
    return len(text).to_bytes(8, "big") + text


@pytest.mark.parametrize("data, words", [
    (header([["exec", "x"]]), "unknown operation"),
    (header([["add", "r", {"prompt_token_ids": [1, "2"]}, None]]), "prompt_token_ids must be a list of integer"),
    (header([["add", "r", {"pd_source": {}}, None]]), "prompt must be a dict of"),
    (header([["add", "r", "p", {"__class__": "os.system"}]]), "params must be SamplingParams' fields"),
    (header([["add", "r", "p", {"temperature": -1}]]), "temperature must be >= 0"),
    (header([], [{"dtype": "|O", "shape": [1]}]), "array must be a dtype in"),
    (header([], [{"dtype": "<f4", "shape": [4]}]) + b"\0" * 8, "within the broadcast"),
    (header([], [{"dtype": "<f4", "shape": [1]}]) + b"\0" * 8, "no bytes past its arrays"),
    (header([["add", "r", {"multi_modal_data": {"image": [{"kind": "image", "pixel_values": {"array": 0},
                                                           "grid_thw": [1, 4, 4], "num_tokens": 4,
                                                           "content_hash": "h", "timestamps": []}]}}, None]]),
     "pixel_values must be a reference"),
    (b"\0\0\0\0\0\0\0\x40{}", "claims 64 bytes"),
])
def test_malformed_broadcasts_are_refused_with_the_reason(data, words):
    with pytest.raises(ValueError, match=words):
        decode_ops(data)


def test_what_the_schema_cannot_carry_is_refused_on_rank0():
    with pytest.raises(ValueError, match="pd_source"):
        encode_ops([("add", "r", {"prompt_token_ids": [1], "pd_source": {"prefill_url": "x"}}, None)])
    with pytest.raises(ValueError, match="preprocessed VisualInput"):
        encode_ops([("add", "r", {"prompt_token_ids": [1], "multi_modal_data": {"image": [object()]}}, None)])


def test_a_picture_whose_hash_is_not_its_pixels_is_refused():
    """The hash keys the prefix and encoder caches: a follower computes it from the pixels and refuses a broadcast
    that claims another."""
    data = encode_ops([("add", "r", {"prompt_token_ids": [1], "multi_modal_data": {"image": [picture()]}}, None)])
    other = VisualInput("image", np.ones((16, 12), np.float32), (1, 4, 4), 4).content_hash
    tampered = data.replace(picture().content_hash.encode(), other.encode())
    assert tampered != data
    with pytest.raises(ValueError, match="content_hash must be the hash of the pixels"):
        decode_ops(tampered)
