"""The quantized cache through the engine: `kv_cache_dtype="fp8"` (e4m3 KV pages) and `mamba_ssm_cache_dtype=
"bfloat16"` (stored snapshots in the host tier and the persisted cache). A prefix-cache hit equals a cold run with the
same dtypes; the persisted file holds the narrow dtypes, a restart with them serves the next turn from it, and a
restart with other dtypes never loads it (the fingerprint names the dtype)."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import qnext
from qnext import SamplingParams
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=16,
              num_gpu_blocks_override=16, max_num_snapshots=4)
NARROW = dict(kv_cache_dtype="fp8", mamba_ssm_cache_dtype="bfloat16")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # token ids only: the tiny vocabulary keeps the engines' compilations short
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fp8cache"), "qwen3_5")


def logprobs(out):
    o = out.outputs[0]
    return np.array([d[t].logprob for t, d in zip(o.token_ids, o.logprobs)])


def test_fp8_kv_and_bf16_snapshots_cached_equals_cold(checkpoint):
    cold = qnext.LLM(checkpoint, enable_prefix_caching=False, **NARROW, **ENGINE)
    cached = qnext.LLM(checkpoint, **NARROW, **ENGINE)
    assert cached.engine.scheduler.cache.buffers.kv[0][0].dtype.name == "float8_e4m3fn"
    rng = np.random.default_rng(0)
    history, reused = rng.integers(3, 500, 37).tolist(), []
    for _ in range(3):
        prompt = {"prompt_token_ids": history}
        want, got = cold.generate(prompt, GREEDY)[0], cached.generate(prompt, GREEDY)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        np.testing.assert_allclose(logprobs(got), logprobs(want), atol=1e-4)
        reused.append(got.num_cached_tokens)
        history = history + list(got.outputs[0].token_ids) + rng.integers(3, 500, 20).tolist()
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1], reused


def test_persisted_cache_keeps_the_narrow_dtypes_and_binds_them(checkpoint, tmp_path, caplog):
    rng = np.random.default_rng(1)
    first = rng.integers(3, 500, 40).tolist()
    with qnext.LLM(checkpoint, prefix_cache_dir=str(tmp_path), **NARROW, **ENGINE) as llm:
        reply = list(llm.generate({"prompt_token_ids": first}, GREEDY)[0].outputs[0].token_ids)
    data = (tmp_path / "prefix_cache.qnext").read_bytes()
    header = json.loads(data[16:16 + int.from_bytes(data[8:16], "little")])
    dtypes = {a["name"].split(".")[0]: a["dtype"] for a in header["arrays"]}
    assert dtypes["kv"] == "float8_e4m3fn" and dtypes["recurrent"] == "bfloat16", dtypes
    assert header["fingerprint"]["kv_dtype"] == "float8_e4m3fn"
    second = {"prompt_token_ids": first + reply + rng.integers(3, 500, 20).tolist()}
    expected = qnext.LLM(checkpoint, enable_prefix_caching=False, **NARROW, **ENGINE).generate(second, GREEDY)[0]
    restarted = qnext.LLM(checkpoint, prefix_cache_dir=str(tmp_path), **NARROW, **ENGINE)
    got = restarted.generate(second, GREEDY)[0]
    assert got.num_cached_tokens == 32 and restarted.engine.cache_stats.tiers.snapshots_loaded > 0
    # the restored state was rounded to bf16 once (the live state then accumulates in float32 again)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    np.testing.assert_allclose(logprobs(got), logprobs(expected), atol=2e-2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qnext.cache"):
        other = qnext.LLM(checkpoint, prefix_cache_dir=str(tmp_path), **dict(NARROW, mamba_ssm_cache_dtype="auto"),
                          **ENGINE)
    assert [r for r in caplog.records if "snapshot_dtype" in r.getMessage()], [r.getMessage() for r in caplog.records]
    assert other.generate(second, GREEDY)[0].num_cached_tokens == 0


def test_fingerprint_names_each_storage_dtype(checkpoint):
    from qnext.engine.cache_setup import prefix_cache_fingerprint
    from qnext.engine.config import EngineConfig
    from qnext.model.checkpoint import read_config

    cfg = read_config(checkpoint)
    fingerprints = {(kv, ssm): prefix_cache_fingerprint(cfg, EngineConfig(kv_cache_dtype=kv, mamba_ssm_cache_dtype=ssm),
                                                        "w")
                    for kv in ("auto", "fp8") for ssm in ("auto", "bfloat16")}
    assert fingerprints["fp8", "bfloat16"]["kv_dtype"] == "float8_e4m3fn"
    assert fingerprints["auto", "auto"]["kv_dtype"] == "float32"
    assert fingerprints["fp8", "bfloat16"]["snapshot_dtype"] == "bfloat16"
    assert len({json.dumps(f, sort_keys=True) for f in fingerprints.values()}) == 4
