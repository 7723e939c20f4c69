"""The engine's cache sized in bytes (kv_cache_memory_bytes, gpu_memory_utilization), cache_info(), and what a
request reports about its prefix hit."""
from __future__ import annotations

import jax
import pytest

import qnext
from qnext import SamplingParams
from qnext.model.buckets import StepLayout

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def buffer_bytes(llm) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(llm.engine.scheduler.cache.buffers))


@pytest.mark.parametrize("snapshots", ["auto", "bfloat16"], ids=["float32_snapshots", "bf16_snapshot_pool"])
def test_byte_budget_bounds_the_buffers_and_cache_info_agrees(tiny_checkpoint, snapshots):
    """With a bf16 snapshot pool too: the buffers (float32 live and staging rows, the narrow pool) are the bytes
    the sizing counted."""
    budget = 600_000
    llm = qnext.LLM(tiny_checkpoint("qwen3_next"), kv_cache_memory_bytes=budget, mamba_ssm_cache_dtype=snapshots,
                    **ENGINE)
    info = llm.cache_info()
    assert set(info) == {"num_blocks", "block_size", "kv_bytes", "num_live_rows", "num_snapshot_rows",
                         "num_staging_rows", "state_bytes", "budget_bytes"}
    assert (info["num_staging_rows"] > 0) == (snapshots == "bfloat16")
    assert buffer_bytes(llm) == info["kv_bytes"] + info["state_bytes"] <= budget == info["budget_bytes"]
    assert info["num_live_rows"] == ENGINE["max_num_seqs"] and info["num_snapshot_rows"] > 0
    assert info["num_blocks"] * info["block_size"] >= ENGINE["max_model_len"]
    out = llm.generate({"prompt_token_ids": list(range(3, 40))}, GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_budget_too_small_for_one_sequence_names_the_numbers(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"cache budget 20000 bytes cannot hold one sequence of max_model_len 128"):
        qnext.LLM(tiny_checkpoint("qwen3_next"), kv_cache_memory_bytes=20_000, **ENGINE)


def test_gpu_memory_utilization_sizes_the_cache_from_memory_stats(tiny_checkpoint, monkeypatch):
    """The GPU path, with the device's memory_stats() faked: the budget is the utilised share of the device's
    memory minus what is in use (weights) and the largest step's activations."""
    import qnext.engine.cache_setup as cache_setup

    limit, in_use = 4_000_000, 300_000
    monkeypatch.setattr(cache_setup, "device_memory_stats", lambda: {"bytes_limit": limit, "bytes_in_use": in_use})
    llm = qnext.LLM(tiny_checkpoint("qwen3_next"), gpu_memory_utilization=0.5, **ENGINE)
    activations = llm.engine.runner.activation_bytes()
    assert activations > 0
    info = llm.cache_info()
    assert info["budget_bytes"] == int(0.5 * limit) - in_use - activations
    assert buffer_bytes(llm) <= info["budget_bytes"]
    monkeypatch.setattr(cache_setup, "device_memory_stats", lambda: {"bytes_limit": limit, "bytes_in_use": limit})
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5 of 4000000 device bytes leaves nothing"):
        qnext.LLM(tiny_checkpoint("qwen3_next"), gpu_memory_utilization=0.5, **ENGINE)


def test_kv_match_without_a_state_is_reported_per_request(tiny_checkpoint):
    """No snapshot rows: the second run of a prompt matches its KV but must recompute it for want of a state."""
    llm = qnext.LLM(tiny_checkpoint("qwen3_next"), max_num_snapshots=0, **ENGINE)
    prompt = {"prompt_token_ids": list(range(3, 43))}          # 40 tokens: 2 full blocks can be matched
    llm.generate(prompt, GREEDY)
    out = llm.generate(prompt, GREEDY)[0]
    assert out.num_cached_tokens == 0
    assert out.metrics.num_lost_to_missing_state_tokens == 32


def test_rolled_back_admission_leaves_no_trace_on_the_request(tiny_checkpoint, monkeypatch):
    """An admission that no compiled step shape holds this step is rolled back; if the snapshot it matched is gone
    by the admission that runs, the request reports what that one served (nothing), not the rolled-back hit."""
    llm = qnext.LLM(tiny_checkpoint("qwen3_next"), **ENGINE)
    prompt = list(range(3, 43))
    llm.generate({"prompt_token_ids": prompt}, GREEDY)             # caches the prompt's blocks and snapshot
    engine = llm.engine
    engine.add_request("again", {"prompt_token_ids": prompt}, GREEDY)
    real_try_add = StepLayout.try_add
    monkeypatch.setattr(StepLayout, "try_add", lambda self, *a: False)
    assert engine.scheduler.schedule() is None                    # admitted, then rolled back
    seq = engine.requests["again"]
    assert seq.num_cached_tokens is None and seq.first_scheduled_time is None
    monkeypatch.setattr(StepLayout, "try_add", real_try_add)
    engine.scheduler.cache.clear_prefix_cache()                   # the snapshot is gone before the real admission
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].num_cached_tokens == 0
    assert engine.cache_stats.reused_tokens == 0                  # the rolled-back admission's counts were taken back


def test_activation_bytes_budgets_a_step_whose_temporaries_grow_with_the_cache(tiny_checkpoint, monkeypatch,
                                                                               caplog):
    """The real step's temporaries do not grow with the cache (measured at two cache sizes); a step that copies a
    cache buffer (here: flips every buffer, which XLA cannot do in place) is reported as a bug and its copies are
    budgeted, so the cache plus the step's temporaries still fit the utilised memory."""
    import jax.numpy as jnp

    import qnext.engine.cache_setup as cache_setup

    limit, in_use = 400_000_000, 300_000
    monkeypatch.setattr(cache_setup, "device_memory_stats", lambda: {"bytes_limit": limit, "bytes_in_use": in_use})
    llm = qnext.LLM(tiny_checkpoint("qwen3_next"), gpu_memory_utilization=0.5, **ENGINE)
    runner = llm.engine.runner
    with caplog.at_level("ERROR", logger="qnext.engine"):
        temp = runner.activation_bytes()
    assert temp > 0 and "grow with the cache" not in caplog.text

    def copying_step(params, buffers, inputs):
        return jnp.zeros(()), jnp.zeros(()), jax.tree.map(lambda x: jnp.flip(x, 0), buffers)

    monkeypatch.setattr(runner, "_step", jax.jit(copying_step, donate_argnums=(1,)))
    with caplog.at_level("ERROR", logger="qnext.engine"):
        budgeted = runner.activation_bytes()
    assert "grow with the cache" in caplog.text
    free = 0.5 * limit - in_use
    assert budgeted > free / 4          # the flip copies (nearly) every buffer: about half of what is free


def test_a_prompt_waits_for_a_sibling_computing_its_prefix_and_restores_where_they_part(tiny_checkpoint):
    """Two prompts sharing 80 tokens arrive together: the second waits while the first computes them (a 64-token
    step budget: two steps), the first captures a snapshot at 80, and the second restores there instead of computing
    the 80 tokens in parallel. Outputs equal each prompt's without the cache."""
    shared = list(range(3, 83))
    prompts = [{"prompt_token_ids": shared + list(range(100 + 20 * i, 120 + 20 * i))} for i in range(2)]
    cached = qnext.LLM(tiny_checkpoint("qwen3_next"), **ENGINE).generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in cached] == [0, 80]
    cold = qnext.LLM(tiny_checkpoint("qwen3_next"), enable_prefix_caching=False, **ENGINE).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in cold]
