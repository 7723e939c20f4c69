"""The bytes rank 0 broadcasts to the other ranks before each step: its queued request operations, in a fixed schema
(never pickle: a follower decodes only plain data, and rejects anything else with a ValueError naming it).

Layout: an 8-byte big-endian header length, the UTF-8 JSON header, then the arrays' bytes back to back in the
header's order. The header is `{"version": 1, "ops": [...], "arrays": [{"dtype", "shape"}, ...]}`; an array inside
an op is `{"array": i}`, its bytes at the running offset (C order, little endian, dtype from ARRAY_DTYPES).
The ops (multiprocess.LockstepEngine):
  ["add", request_id, prompt, params]   prompt: a string, a list of token ids, or a dict of PROMPT_KEYS;
                                        params: SamplingParams' fields (None: the defaults)
  ["abort", request_id], ["release", request_id], ["shutdown"]
A picture in a prompt's multi_modal_data is a preprocessed VisualInput, sent field by field."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

VERSION = 1
ARRAY_DTYPES = ("<f4", "<f8", "<f2", "<i4", "<i8", "|u1", "|b1")
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")
VISUAL_KINDS = ("image", "video")
ONE_ID_OPS = ("abort", "release")
HEADER_BYTES = 8


def encode_ops(ops: list) -> bytes:
    """ValueError (before anything is sent) for an op or value outside the schema."""
    arrays: list[np.ndarray] = []
    header = {"version": VERSION, "ops": [_encode_op(op, arrays) for op in ops],
              "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]}
    text = json.dumps(header, allow_nan=True, separators=(",", ":")).encode()
    return b"".join([len(text).to_bytes(HEADER_BYTES, "big"), text, *(a.tobytes() for a in arrays)])


def decode_ops(data: bytes) -> list[tuple]:
    """The ops `encode_ops` wrote; ValueError naming what is malformed."""
    if len(data) < HEADER_BYTES:
        raise ValueError(f"a request broadcast of {len(data)} bytes is shorter than its header length")
    size = int.from_bytes(data[:HEADER_BYTES], "big")
    if size > len(data) - HEADER_BYTES:
        raise ValueError(f"a request broadcast's header claims {size} bytes; only {len(data) - HEADER_BYTES} follow")
    try:
        header = json.loads(data[HEADER_BYTES:HEADER_BYTES + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"a request broadcast's header is not JSON ({e})") from None
    _expect(isinstance(header, dict) and header.get("version") == VERSION, "header", f"version {VERSION}")
    _expect(isinstance(header.get("ops"), list) and isinstance(header.get("arrays"), list), "header",
            "lists 'ops' and 'arrays'")
    arrays = _decode_arrays(header["arrays"], memoryview(data)[HEADER_BYTES + size:])
    return [_decode_op(op, arrays) for op in header["ops"]]


# ---- encoding ------------------------------------------------------------------------------------------------
def _encode_op(op, arrays: list) -> list:
    kind = op[0] if isinstance(op, (tuple, list)) and op else None
    if kind == "add" and len(op) == 4:
        _expect(isinstance(op[1], str), "request id", "a string")
        return ["add", op[1], _encode_prompt(op[2], arrays), _encode_params(op[3])]
    if kind in ONE_ID_OPS and len(op) == 2 and isinstance(op[1], str):
        return [kind, op[1]]
    if kind == "shutdown" and len(op) == 1:
        return ["shutdown"]
    raise ValueError(f"cannot send the operation {str(op)[:80]!r} to the other ranks")


def _encode_prompt(prompt, arrays: list):
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt")
    _expect(isinstance(prompt, dict), "prompt", "a string, a list of token ids or a dict")
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    _expect(not unknown, "prompt", f"a dict of {PROMPT_KEYS} (it has {unknown})")
    out = {}
    if "prompt" in prompt:
        _expect(prompt["prompt"] is None or isinstance(prompt["prompt"], str), "prompt.prompt", "a string or None")
        out["prompt"] = prompt["prompt"]
    if "prompt_token_ids" in prompt:
        out["prompt_token_ids"] = _token_ids(prompt["prompt_token_ids"], "prompt_token_ids")
    if prompt.get("multi_modal_data"):
        data = prompt["multi_modal_data"]
        _expect(isinstance(data, dict) and set(data) <= set(VISUAL_KINDS), "multi_modal_data",
                f"a dict of {VISUAL_KINDS}")
        out["multi_modal_data"] = {kind: [_encode_visual(v, arrays) for v in _as_list(items)]
                                   for kind, items in data.items() if items is not None}
    return out


def _encode_visual(visual, arrays: list) -> dict:
    from qnext.vision.preprocess import VisualInput

    _expect(isinstance(visual, VisualInput), "multi_modal_data item",
            "a preprocessed VisualInput (the server preprocesses pictures before they reach the engine)")
    arrays.append(_array(visual.pixel_values))
    return {"kind": visual.kind, "pixel_values": {"array": len(arrays) - 1},
            "grid_thw": [int(x) for x in visual.grid_thw], "num_tokens": int(visual.num_tokens),
            "content_hash": visual.content_hash, "timestamps": [float(t) for t in visual.timestamps]}


def _encode_params(params):
    if params is None:
        return None
    from qnext.sampling_params import SamplingParams

    _expect(isinstance(params, SamplingParams), "params", "a SamplingParams")
    return dataclasses.asdict(params)


def _array(value) -> np.ndarray:
    a = np.ascontiguousarray(value)
    a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
    _expect(a.dtype.str in ARRAY_DTYPES, "array", f"of a dtype in {ARRAY_DTYPES} (got {a.dtype.str})")
    return a


# ---- decoding ------------------------------------------------------------------------------------------------
def _decode_arrays(specs: list, body: memoryview) -> list[np.ndarray]:
    out, offset = [], 0
    for spec in specs:
        _expect(isinstance(spec, dict) and spec.get("dtype") in ARRAY_DTYPES, "array", f"a dtype in {ARRAY_DTYPES}")
        shape = spec.get("shape")
        _expect(isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape), "array shape",
                "a list of non-negative integers")
        nbytes = math.prod(shape) * np.dtype(spec["dtype"]).itemsize
        _expect(offset + nbytes <= len(body), "array", f"within the broadcast ({nbytes} bytes at {offset})")
        out.append(np.frombuffer(body[offset:offset + nbytes], spec["dtype"]).reshape(shape).copy())
        offset += nbytes
    _expect(offset == len(body), "broadcast", f"no bytes past its arrays ({len(body) - offset} extra)")
    return out


def _decode_op(op, arrays: list) -> tuple:
    kind = op[0] if isinstance(op, list) and op else None
    if kind == "add" and len(op) == 4:
        _expect(isinstance(op[1], str), "request id", "a string")
        return "add", op[1], _decode_prompt(op[2], arrays), _decode_params(op[3])
    if kind in ONE_ID_OPS and len(op) == 2 and isinstance(op[1], str):
        return kind, op[1]
    if kind == "shutdown" and len(op) == 1:
        return ("shutdown",)
    raise ValueError(f"a request broadcast holds an unknown operation {str(op)[:80]!r}")


def _decode_prompt(prompt, arrays: list):
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt")
    _expect(isinstance(prompt, dict) and set(prompt) <= set(PROMPT_KEYS), "prompt", f"a dict of {PROMPT_KEYS}")
    out = dict(prompt)
    if "prompt" in out:
        _expect(out["prompt"] is None or isinstance(out["prompt"], str), "prompt.prompt", "a string or None")
    if "prompt_token_ids" in out:
        out["prompt_token_ids"] = _token_ids(out["prompt_token_ids"], "prompt_token_ids")
    if "multi_modal_data" in out:
        data = out["multi_modal_data"]
        _expect(isinstance(data, dict) and set(data) <= set(VISUAL_KINDS) and
                all(isinstance(v, list) for v in data.values()), "multi_modal_data", f"lists under {VISUAL_KINDS}")
        out["multi_modal_data"] = {kind: [_decode_visual(v, arrays) for v in items] for kind, items in data.items()}
    return out


def _decode_visual(item, arrays: list):
    from qnext.vision.preprocess import VisualInput

    fields = ("kind", "pixel_values", "grid_thw", "num_tokens", "content_hash", "timestamps")
    _expect(isinstance(item, dict) and set(item) == set(fields), "multi_modal_data item", f"the fields {fields}")
    ref = item["pixel_values"]
    _expect(isinstance(ref, dict) and _is_int(ref.get("array")) and 0 <= ref["array"] < len(arrays),
            "pixel_values", "a reference to one of the broadcast's arrays")
    _expect(item["kind"] in VISUAL_KINDS and isinstance(item["content_hash"], str), "multi_modal_data item",
            f"a kind in {VISUAL_KINDS} and a content_hash string")
    grid = item["grid_thw"]
    _expect(isinstance(grid, list) and len(grid) == 3 and all(_is_int(n) and n > 0 for n in grid), "grid_thw",
            "three positive integers")
    _expect(_is_int(item["num_tokens"]) and item["num_tokens"] > 0, "num_tokens", "a positive integer")
    times = item["timestamps"]
    _expect(isinstance(times, list) and all(isinstance(t, (int, float)) for t in times), "timestamps",
            "a list of numbers")
    visual = VisualInput(item["kind"], arrays[ref["array"]], tuple(grid), item["num_tokens"],
                         tuple(float(t) for t in times))        # its content hash is computed from the pixels
    _expect(visual.content_hash == item["content_hash"], "content_hash", "the hash of the pixels it came with")
    return visual


def _decode_params(fields):
    if fields is None:
        return None
    from qnext.sampling_params import SamplingParams

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    _expect(isinstance(fields, dict) and set(fields) <= names, "params", "SamplingParams' fields")
    return SamplingParams(**fields)          # its own checks reject bad values


def _token_ids(ids, where: str) -> list[int]:
    ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids) if isinstance(ids, tuple) else ids
    _expect(isinstance(ids, list) and all(_is_int(t) for t in ids), where, "a list of integer token ids")
    return [int(t) for t in ids]


def _as_list(items) -> list:
    return list(items) if isinstance(items, (list, tuple)) else [items]


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _expect(ok: bool, what: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"request broadcast: {what} must be {rule}")
