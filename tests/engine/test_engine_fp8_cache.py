"""The quantized cache through the engine: `kv_cache_dtype="fp8"` (e4m3 KV pages) and `mamba_ssm_cache_dtype=
"bfloat16"` (stored snapshots: the device's snapshot pool, the host tier and the persisted cache). A prefix-cache hit
restored from a bf16 device snapshot gives a cold run's tokens (same KV dtype) with logprobs within the bound of one
bf16 rounding of the state, as does a hit through the host tier; the snapshot pool holds about twice the rows at
the same bytes; the persisted file holds the narrow dtypes, a restart with them serves the next turn from it, and a
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


# One bf16 rounding of the restored state (relative 2^-9), measured at ~1e-5 on the tiny model; the bound is the
# host tier's (docs/fp8.md).
BF16_STATE_ATOL = 2e-2


def chat(engines: dict, rounds: int, seed: int = 0, chats: int = 1) -> dict:
    """Multi-turn chats (rounds interleaved), each turn through every engine; -> per engine, the outputs in order."""
    rng = np.random.default_rng(seed)
    histories, outs = [rng.integers(3, 500, 37).tolist() for _ in range(chats)], {name: [] for name in engines}
    for _ in range(rounds):
        for i, history in enumerate(histories):
            got = {name: llm.generate({"prompt_token_ids": history}, GREEDY)[0] for name, llm in engines.items()}
            for name, out in got.items():
                outs[name].append(out)
            reply = list(next(iter(got.values())).outputs[0].token_ids)
            histories[i] = history + reply + rng.integers(3, 500, 20).tolist()
    return outs


def assert_close_to(outs, expected, atol):
    for got, want in zip(outs, expected):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        np.testing.assert_allclose(logprobs(got), logprobs(want), atol=atol)


def test_fp8_kv_and_bf16_device_snapshots_cached_equals_cold(checkpoint):
    cold = qnext.LLM(checkpoint, enable_prefix_caching=False, **NARROW, **ENGINE)
    cached = qnext.LLM(checkpoint, **NARROW, **ENGINE)
    wide = qnext.LLM(checkpoint, **dict(NARROW, mamba_ssm_cache_dtype="auto"), **ENGINE)
    buffers = cached.engine.scheduler.cache.buffers
    assert buffers.kv[0][0].dtype.name == "float8_e4m3fn" and buffers.recurrent[0].dtype.name == "float32"
    assert buffers.snapshot_recurrent[0].dtype.name == "bfloat16" and buffers.snapshot_recurrent[0].shape[0] == 4
    assert not wide.engine.scheduler.cache.buffers.snapshot_recurrent      # float32: one buffer, as before
    outs = chat({"cold": cold, "cached": cached, "wide": wide}, rounds=3)
    assert_close_to(outs["wide"], outs["cold"], 1e-4)
    assert_close_to(outs["cached"], outs["cold"], BF16_STATE_ATOL)
    assert_close_to(outs["cached"], outs["wide"], BF16_STATE_ATOL)
    reused = [o.num_cached_tokens for o in outs["cached"]]
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1], reused
    stats = cached.engine.cache_stats
    assert stats.snapshots_restored == 2 and stats.tiers.device_hit_tokens == sum(reused)   # from the device pool


def test_bf16_device_snapshots_through_the_host_tier_equal_cold(checkpoint):
    """4 device snapshot rows, three chats: each turn evicts the others' snapshots to the host tier (bf16 both
    sides) and restores its own from there."""
    host = 4 * (16 * 8192 + 4 * 16896) / 2 ** 30
    cold = qnext.LLM(checkpoint, enable_prefix_caching=False, **NARROW, **ENGINE)
    tiered = qnext.LLM(checkpoint, kv_offloading_size=host, **NARROW, **ENGINE)
    assert tiered.engine.cache.host_buffers.recurrent[0].dtype.name == "bfloat16"
    outs = chat({"cold": cold, "tiered": tiered}, rounds=2, seed=2, chats=3)
    assert_close_to(outs["tiered"], outs["cold"], BF16_STATE_ATOL)
    t = tiered.engine.cache_stats.tiers
    assert t.snapshots_offloaded > 0 and t.snapshots_loaded > 0 and t.host_hits > 0


def test_the_bf16_snapshot_pool_holds_about_twice_the_rows_at_the_same_bytes(checkpoint):
    from qnext.bench.presets import PRESETS
    from qnext.config import ModelConfig
    from qnext.engine.cache_setup import STAGING_ROWS, cache_sizes
    from qnext.engine.config import EngineConfig
    from qnext.testing.tiny_checkpoint import tiny_hf_config

    preset = PRESETS["small"]
    cfg = ModelConfig.from_hf_config(tiny_hf_config(preset.family, **preset.overrides))
    base = dict(dtype="bfloat16", max_num_seqs=16, block_size=16, kv_cache_memory_bytes=1 << 30,
                snapshot_memory_bytes=256 << 20)
    wide, narrow = (cache_sizes(cfg, EngineConfig(**base, mamba_ssm_cache_dtype=d), 4096) for d in ("auto", "bfloat16"))
    assert narrow.num_staging_rows == STAGING_ROWS and wide.num_staging_rows == 0
    assert narrow.snapshot_row_bytes < 0.55 * wide.live_row_bytes
    assert 1.8 < narrow.num_snapshot_rows / wide.num_snapshot_rows <= 2.0, (narrow, wide)
    assert narrow.kv_bytes + narrow.state_bytes <= narrow.budget_bytes


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


def test_a_step_stages_at_most_its_staging_rows_of_captures_and_skips_the_rest(checkpoint, monkeypatch):
    """Three 20-token prompts each capture after 16 tokens, inside their segment: with one staging row a step
    captures only its first (the others capture nothing, rather than register a state never written), and the next
    turns still equal cold runs."""
    import qnext.engine.cache_setup as cache_setup

    monkeypatch.setattr(cache_setup, "STAGING_ROWS", 1)
    cold = qnext.LLM(checkpoint, enable_prefix_caching=False, **NARROW, **ENGINE)
    capped = qnext.LLM(checkpoint, **NARROW, **ENGINE)
    assert capped.engine.scheduler.cache.config.num_staging_rows == 1
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, 20).tolist()} for _ in range(3)]
    first = capped.generate(prompts, GREEDY)
    assert capped.engine.cache_stats.snapshots_captured < 3
    turns = [{"prompt_token_ids": p["prompt_token_ids"] + list(o.outputs[0].token_ids) + [7] * 10}
             for p, o in zip(prompts, first)]
    got, want = capped.generate(turns, GREEDY), cold.generate(turns, GREEDY)
    reused = [o.num_cached_tokens for o in got]
    assert 0 in reused and 16 in reused, reused
    assert_close_to(got, want, BF16_STATE_ATOL)
