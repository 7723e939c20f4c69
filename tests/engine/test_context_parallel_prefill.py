"""Context-parallel prefill in the engine (EngineConfig.context_parallel_size, qnext/model/context_parallel_step.py):
a long prompt prefilled over 4 XLA host devices gives the tokens and logprobs of one device, its steps do run split,
and it feeds the prefix cache: a second request with the same prefix is served from it and equals a cold run.

Runs in a subprocess started with 4 CPU devices (the flag must be set before JAX starts; this process has one).
Tolerance 1e-4 on logprobs (float32; the state entering each shard is the fold's, which rounds differently from the
sequential scan)."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests.support.host_device_script import run_on_host_devices

_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    import qnext
    from qnext import SamplingParams
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(sys.argv[1] + "/tiny", "qwen3_5", seed=3, max_position_embeddings=1024)
    rng = np.random.default_rng(0)
    first = rng.integers(3, 500, 700).tolist()             # steps of 256, 256 and 188 tokens, each split 4 ways
    second = first + rng.integers(3, 500, 40).tolist()     # the same prefix, then 40 new tokens
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
    options = dict(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=1024, compilation_cache_dir="none")
    out = {}
    for name, extra in (("split", dict(context_parallel_size=4)), ("cold", dict(enable_prefix_caching=False))):
        llm = qnext.LLM(path, **options, **extra)
        if name == "split":       # warm-up of the split step writes nothing but the dummy block and row
            engine = llm.engine
            bucket = max(engine.runner.buckets.all, key=lambda b: b.sizes.num_tokens)
            buffers = engine.runner.context_parallel.warm_up(engine.runner.params, engine.cache.lend_buffers(), bucket)
            out["warm_up_steps"] = engine.runner.context_parallel.steps
            out["warm_up_compiled"] = engine.runner.context_parallel._step._cache_size()
            out["warm_up_wrote"] = max(float(np.abs(np.asarray(x)).max()) for x in
                                       [kv[:, 1:] for pair in buffers.kv for kv in pair]
                                       + list(buffers.conv) + list(buffers.recurrent))
            engine.cache.return_buffers(buffers)
        runs = []
        for prompt in (first, second):
            got = llm.generate([{"prompt_token_ids": prompt}], params)[0]
            runs.append({"tokens": list(got.outputs[0].token_ids), "cached": got.num_cached_tokens,
                         "logprobs": [[lp[t].logprob for t in sorted(lp)] for lp in got.outputs[0].logprobs]})
        out[name] = runs
        if name == "split":
            out["split_steps"] = llm.engine.runner.context_parallel.steps
            buffers = llm.engine.cache.lend_buffers()
            out["replicated"] = all(len(leaf.sharding.device_set) == 4 for leaf in jax.tree.leaves(buffers))
            llm.engine.cache.return_buffers(buffers)
        llm.close()
    print(json.dumps(out))
""")


def test_context_parallel_prefill_equals_one_device_and_feeds_the_prefix_cache(tmp_path):
    out = run_on_host_devices(_SCRIPT, 4, str(tmp_path), timeout=900)
    split, cold = out["split"], out["cold"]
    assert out["warm_up_compiled"] == 1 and out["warm_up_steps"] == 0 and out["warm_up_wrote"] == 0.0
    assert out["split_steps"] >= 3 and out["replicated"]   # the first prompt's 3 steps ran over the 4 devices
    assert split[0]["cached"] == 0 and split[1]["cached"] >= 688 and cold[1]["cached"] == 0
    for got, want in zip(split, cold):
        assert got["tokens"] == want["tokens"]
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)


def test_context_parallel_options_refused_with_reason():
    from qnext.engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineConfig(context_parallel_size=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="float32 snapshots"):
        EngineConfig(context_parallel_size=2, mamba_ssm_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="context_parallel_size must be a positive integer"):
        EngineConfig(context_parallel_size=0)
