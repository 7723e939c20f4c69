"""The flagship's head counts over 8 XLA host devices (qnext/model/tensor_parallel.py): TP8 with 2 KV heads (each
replicated over 4 devices), expert parallelism over the 8 devices with attention TP and with the mixers whole on
every device. Each gives the single device's greedy tokens and logprobs, multi-step decode and a cached chat turn,
for a MoE Qwen3.5 and a Qwen3-Next tiny checkpoint; under EP each device holds 1/8 of the expert bytes.

One subprocess started with 8 CPU devices runs every engine (the flag must be set before JAX starts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

# Qwen3.5-397B-A17B: 32 query / 2 KV heads, 16 / 64 DeltaNet key / value heads; Qwen3-Next-80B: 16 / 2, 16 / 32
FLAGSHIP_HEADS = {
    "qwen3_5_moe": dict(num_attention_heads=32, num_key_value_heads=2, linear_num_key_heads=16,
                        linear_num_value_heads=64),
    "qwen3_next": dict(num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16,
                       linear_num_value_heads=32),
}
LAYOUTS = {"tp1": dict(tensor_parallel_size=1), "tp8": dict(tensor_parallel_size=8),
           "ep8": dict(tensor_parallel_size=8, enable_expert_parallel=True),
           "ep8_whole_attention": dict(tensor_parallel_size=8, enable_expert_parallel=True,
                                       attention_tensor_parallel=False)}
# every layout is compiled anew (~1 min on 2 cores): each family runs the single device and the layouts that
# cover it together (KV heads replicated under TP8 and under EP with attention TP; EP with the mixers whole)
RUNS = {"qwen3_5_moe": ("tp1", "tp8", "ep8_whole_attention"), "qwen3_next": ("tp1", "ep8")}

_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import qnext
    from qnext import SamplingParams
    from qnext.model.tensor_parallel import device_bytes
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    heads, layouts, runs = json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
    out = {}
    for family in heads:
        # two layers: a DeltaNet layer and a full-attention one (Qwen3-Next's is its dense-MLP layer)
        path = write_tiny_checkpoint(sys.argv[1] + "/" + family, family, seed=3, num_experts=16,
                                     num_experts_per_tok=4, num_hidden_layers=2,
                                     layer_types=["linear_attention", "full_attention"], **heads[family])
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in (5, 11)]
        messages = [rng.integers(3, 500, n).tolist() for n in (20, 12)]
        for name in runs[family]:
            layout = layouts[name]
            llm = qnext.LLM(path, num_scheduler_steps=4, max_num_seqs=2, max_num_batched_tokens=32,
                            max_model_len=128, block_size=16, num_gpu_blocks_override=24, max_num_snapshots=8,
                            **layout)
            # logprobs run single steps; plain greedy runs several steps per call
            with_logprobs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                 logprobs=1))
            multi = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            history, cached = [], []
            for message in messages:               # a chat: the second turn restores the first's snapshot
                history += message
                o = llm.generate({"prompt_token_ids": history}, SamplingParams(temperature=0, max_tokens=5,
                                                                                ignore_eos=True))[0]
                cached.append(o.num_cached_tokens)
                history += list(o.outputs[0].token_ids)
            params = llm.engine.runner.params
            experts = device_bytes(params, expert_only=True)
            total = sum(leaf.nbytes for path, leaf in __import__("jax").tree_util.tree_leaves_with_path(params)
                        if "experts_" in __import__("jax").tree_util.keystr(path))
            out[f"{family}/{name}"] = {
                "tokens": [list(o.outputs[0].token_ids) for o in with_logprobs],
                "logprobs": [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                             for o in with_logprobs],
                "multi": [list(o.outputs[0].token_ids) for o in multi], "chat": history, "cached": cached,
                "expert_bytes": sorted(experts.values()), "expert_total": total}
            llm.close()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path_factory.mktemp("flagship")),
                           json.dumps(FLAGSHIP_HEADS), json.dumps(LAYOUTS), json.dumps(RUNS)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family,layout", [(f, name) for f, names in RUNS.items() for name in names[1:]])
def test_eight_devices_match_one(runs, family, layout):
    one, many = runs[f"{family}/tp1"], runs[f"{family}/{layout}"]
    assert many["tokens"] == one["tokens"]
    # the all-reduce adds the partial sums in another order than one device's dot: float32 rounding only
    np.testing.assert_allclose(np.array(many["logprobs"]), np.array(one["logprobs"]), atol=1e-5, rtol=0)
    assert many["multi"] == one["multi"] == one["tokens"]
    assert many["chat"] == one["chat"]
    assert many["cached"] == one["cached"] and one["cached"][1] > 0, (one["cached"], many["cached"])


@pytest.mark.parametrize("family", list(FLAGSHIP_HEADS))
def test_expert_parallel_holds_one_eighth_of_the_experts_per_device(runs, family):
    total = runs[f"{family}/tp1"]["expert_total"]
    assert runs[f"{family}/tp1"]["expert_bytes"] == [total]
    for layout in RUNS[family][1:]:     # EP splits the experts; TP their units: 1/8 each either way
        assert runs[f"{family}/{layout}"]["expert_bytes"] == [total // 8] * 8, layout
