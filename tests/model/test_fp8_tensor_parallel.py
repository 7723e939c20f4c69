"""An FP8 checkpoint under tensor parallelism over 2 and 8 XLA host devices gives one device's tokens and logprobs.
On CPU the weights are dequantised at load, before they are sharded, so no 128-block ever straddles a shard.

One subprocess started with 8 CPU devices runs every engine (the flag must be set before JAX starts)."""
from __future__ import annotations

import textwrap

import numpy as np

from tests.support.host_device_script import run_on_host_devices

_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import qnext
    from qnext import SamplingParams
    from qnext.testing.fp8_export import export_fp8
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    # the flagship's head counts (Qwen3.5-397B-A17B: 32 / 2 attention, 16 / 64 DeltaNet heads) on two layers
    src = write_tiny_checkpoint(sys.argv[1] + "/bf16", "qwen3_5_moe", seed=3, dtype="bfloat16", num_experts=16,
                                num_experts_per_tok=4, num_hidden_layers=2, layer_types=["linear_attention",
                                "full_attention"], num_attention_heads=32, num_key_value_heads=2,
                                linear_num_key_heads=16, linear_num_value_heads=64)
    path = export_fp8(src, sys.argv[1] + "/fp8", block_size=(48, 48))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in (5, 19)]
    out = {}
    for tp in (1, 2, 8):
        llm = qnext.LLM(path, tensor_parallel_size=tp, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                        block_size=16, num_gpu_blocks_override=16, max_num_snapshots=4)
        o = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1))
        out[tp] = {"tokens": [list(r.outputs[0].token_ids) for r in o],
                   "logprobs": [[d[t].logprob for t, d in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
                                for r in o]}
        llm.close()
    print(json.dumps(out))
""")


def test_fp8_checkpoint_over_two_and_eight_devices_matches_one(tmp_path):
    out = run_on_host_devices(_SCRIPT, 8, str(tmp_path), timeout=900)
    for tp in ("2", "8"):
        assert out[tp]["tokens"] == out["1"]["tokens"], tp
        # the all-reduce adds partial sums in another order than one device's dot: float32 rounding only
        np.testing.assert_allclose(np.array(out[tp]["logprobs"]), np.array(out["1"]["logprobs"]), atol=1e-5, rtol=0)
