"""Kept fp8 weights (fp8_weights="keep") under tensor parallelism over 2 and 8 XLA host devices: the block scales
are split with their values (fp8_sharding.py), and the tokens and logprobs equal one device's with kept weights and
one device's with dequantised weights. A TP size that would cut a block is refused, naming the tensor and the size.

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
    from qnext.ops.fp8_weight import Fp8Weight
    from qnext.testing.fp8_export import export_fp8
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    # the flagship's head counts (32 / 2 attention heads: KV heads replicated at TP8; 16 / 64 DeltaNet heads);
    # expert widths of 128 so that every device holds whole 16-blocks at TP8
    src = write_tiny_checkpoint(sys.argv[1] + "/bf16", "qwen3_5_moe", seed=3, dtype="bfloat16", num_experts=16,
                                num_experts_per_tok=4, num_hidden_layers=2, layer_types=["linear_attention",
                                "full_attention"], num_attention_heads=32, num_key_value_heads=2,
                                linear_num_key_heads=16, linear_num_value_heads=64, fused_experts=True,
                                moe_intermediate_size=128, shared_expert_intermediate_size=128)
    path = export_fp8(src, sys.argv[1] + "/fp8", block_size=(16, 16))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in (5, 19)]
    out = {}
    for name, tp, mode in (("1", 1, "dequantize"), ("1keep", 1, "keep"), ("2keep", 2, "keep"), ("8keep", 8, "keep")):
        llm = qnext.LLM(path, tensor_parallel_size=tp, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                        block_size=16, num_gpu_blocks_override=16, max_num_snapshots=4, fp8_weights=mode)
        params = llm.engine.runner.params
        kept = [x for x in __import__("jax").tree.leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight))
                if isinstance(x, Fp8Weight)]
        o = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1))
        out[name] = {"tokens": [list(r.outputs[0].token_ids) for r in o], "kept": len(kept),
                     "logprobs": [[d[t].logprob for t, d in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
                                  for r in o]}
        llm.close()
    cut = export_fp8(src, sys.argv[1] + "/fp8_48", block_size=(48, 48))
    try:
        qnext.LLM(cut, tensor_parallel_size=2, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                  num_gpu_blocks_override=16, max_num_snapshots=4, fp8_weights="keep")
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    print(json.dumps(out))
""")


def test_kept_fp8_weights_over_two_and_eight_devices_match_one(tmp_path):
    out = run_on_host_devices(_SCRIPT, 8, str(tmp_path), timeout=900)
    assert out["1"]["kept"] == 0 and out["1keep"]["kept"] == out["2keep"]["kept"] == out["8keep"]["kept"] >= 6
    for name in ("1keep", "2keep", "8keep"):
        assert out[name]["tokens"] == out["1"]["tokens"], name
        # the all-reduce adds partial sums in another order than one device's dot: float32 rounding only
        np.testing.assert_allclose(np.array(out[name]["logprobs"]), np.array(out["1"]["logprobs"]), atol=1e-5,
                                   rtol=0)
    assert out["refused"] and "tensor_parallel_size=2 would cut an fp8 block of weight layers/" in out["refused"]
