"""Tensor parallelism (qnext/model/tensor_parallel.py): two XLA host devices give the tokens and logprobs of one.

The engines run in a subprocess started with two CPU devices (the flag must be set before JAX starts; this test
process has one)."""
from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest

from qnext.model.head_layout import device_major
from qnext.model.tensor_parallel import local_config, make_mesh, replicate_heads, sharded_model_config

from tests.support.host_device_script import run_on_host_devices

_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import qnext
    from qnext import SamplingParams
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    out = {}
    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        # two layers: a DeltaNet layer and a full-attention one (Qwen3-Next's is its dense-MLP layer)
        path = write_tiny_checkpoint(sys.argv[1] + "/" + family, family, seed=3, num_hidden_layers=2,
                                     layer_types=["linear_attention", "full_attention"])
        engine_args = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=16,
                           num_gpu_blocks_override=64, max_num_snapshots=16)
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in (5, 30, 47)]
        messages = [rng.integers(3, 500, n).tolist() for n in (40, 20, 20)]
        for tp in (1, 2):
            llm = qnext.LLM(path, tensor_parallel_size=tp, num_scheduler_steps=4, **engine_args)
            # logprobs run single steps
            with_logprobs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                 logprobs=1))
            result = {"tokens": [list(o.outputs[0].token_ids) for o in with_logprobs],
                      "logprobs": [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                   for o in with_logprobs]}
            if family == "qwen3_5":
                # plain greedy runs several steps per call; a chat restores each turn's snapshot (prefix caching)
                multi = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                history, cached = [], []
                for message in messages:
                    history += message
                    o = llm.generate({"prompt_token_ids": history}, SamplingParams(temperature=0, max_tokens=9,
                                                                                    ignore_eos=True))[0]
                    cached.append(o.num_cached_tokens)
                    history += list(o.outputs[0].token_ids)
                result.update(multi=[list(o.outputs[0].token_ids) for o in multi], chat=history, cached=cached)
            out[f"{family}/{tp}"] = result
    print(json.dumps(out))
""")


def test_two_devices_match_one(tmp_path):
    out = run_on_host_devices(_SCRIPT, 2, str(tmp_path), timeout=900)
    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        one, two = out[f"{family}/1"], out[f"{family}/2"]
        assert two["tokens"] == one["tokens"], family
        # the all-reduce adds the partial sums in another order than one device's dot: float32 rounding only
        np.testing.assert_allclose(np.array(two["logprobs"]), np.array(one["logprobs"]), atol=1e-4)
    one, two = out["qwen3_5/1"], out["qwen3_5/2"]
    assert two["multi"] == one["multi"] == one["tokens"]
    assert two["chat"] == one["chat"]
    assert two["cached"] == one["cached"] and one["cached"][1] > 0, (one["cached"], two["cached"])


def test_fused_segments_go_device_major():
    # two segments [a0 a1 | b0 b1 b2 b3] over 2 devices -> device 0: a0 b0 b1, device 1: a1 b2 b3
    x = np.array([10, 11, 20, 21, 22, 23])
    np.testing.assert_array_equal(device_major(x, 0, [2, 4], 2), [10, 20, 21, 11, 22, 23])
    w = np.arange(12).reshape(2, 6)                    # along axis 1, rows kept
    np.testing.assert_array_equal(device_major(w, 1, [2, 4], 2)[1], [6, 8, 9, 7, 10, 11])


def test_local_config_splits_heads_and_rejects_what_does_not_divide(tiny_checkpoint):
    from qnext.config import ModelConfig

    cfg = ModelConfig.from_pretrained(tiny_checkpoint("qwen3_5"))
    local = local_config(cfg, 2)
    assert local.tensor_parallel_size == 2 and cfg.tensor_parallel_size == 1
    assert (local.num_key_value_heads, local.linear_num_value_heads) == (cfg.num_key_value_heads // 2,
                                                                         cfg.linear_num_value_heads // 2)
    assert local_config(cfg, 1) is cfg
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's num_attention_heads"):
        local_config(cfg, 3)


def test_heads_that_tp_exceeds_are_replicated_exactly(tiny_checkpoint):
    import dataclasses

    from qnext.config import ModelConfig
    from qnext.model.weights import init_params

    cfg = ModelConfig.from_pretrained(tiny_checkpoint("qwen3_5"))     # 4 / 2 query / KV heads, DeltaNet 2 / 4
    wide = sharded_model_config(cfg, 4)
    assert (wide.num_key_value_heads, wide.linear_num_key_heads) == (4, 4)
    assert (local_config(cfg, 4).num_key_value_heads, local_config(cfg, 4).linear_num_key_heads) == (1, 1)
    params = init_params(dataclasses.replace(cfg, attention_bias=True))
    full = cfg.full_layer_ids[0]
    qkv = params["layers"][full]["attn"]["qkv_proj"]
    hq, d = cfg.num_attention_heads, cfg.head_dim
    wide_qkv = replicate_heads(params, dataclasses.replace(cfg, attention_bias=True), 4)["layers"][full]["attn"]
    k, wide_k = qkv[2 * hq * d:2 * hq * d + 2 * d], wide_qkv["qkv_proj"][2 * hq * d:2 * hq * d + 4 * d]
    # KV head j becomes heads 2j and 2j + 1: query head h still reads kv head h // (Hq / Hkv)
    np.testing.assert_array_equal(wide_k, np.concatenate([k[:d], k[:d], k[d:], k[d:]]))
    assert wide_qkv["qkv_bias"].shape == (2 * hq * d + 8 * d,)
    np.testing.assert_array_equal(wide_qkv["qkv_proj"][:2 * hq * d], qkv[:2 * hq * d])       # q and gate kept
    with pytest.raises(ValueError, match="must divide the model's num_key_value_heads \\(2\\) or be a multiple"):
        sharded_model_config(dataclasses.replace(cfg, num_attention_heads=12, linear_num_value_heads=12), 3)


def test_expert_parallel_configurations_it_cannot_serve_fail_at_start(tiny_checkpoint):
    import qnext

    with pytest.raises(ValueError, match="must divide the model's num_experts \\(8\\)"):
        qnext.LLM(tiny_checkpoint("qwen3_5_moe"), tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel needs a MoE model"):
        qnext.LLM(tiny_checkpoint("qwen3_5"), tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel needs tensor_parallel_size > 1"):
        qnext.LLM(tiny_checkpoint("qwen3_5_moe"), enable_expert_parallel=True)


def test_too_few_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 64 devices.*xla_force_host_platform_device_count=64"):
        make_mesh(64)


def test_engine_rejects_bad_tensor_parallel_size(tiny_checkpoint):
    import qnext

    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        qnext.LLM(tiny_checkpoint("qwen3_5"), tensor_parallel_size=0)


def test_request_host_devices_keeps_a_count_already_set(monkeypatch):
    from qnext.model.host_devices import request_host_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    request_host_devices(2)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"
    request_host_devices(4)                                   # a count is set: left alone
    assert os.environ["XLA_FLAGS"].endswith("device_count=2")
    monkeypatch.delenv("XLA_FLAGS")
    request_host_devices(1)
    assert "XLA_FLAGS" not in os.environ
