"""Several processes, one engine (qnext/distributed/multiprocess.py): 2 processes x 2 host devices on the loopback,
tensor parallel over the 4 devices (TP4 across processes; KV and DeltaNet key heads replicated), give the single
device's greedy tokens and logprobs, multi-step decode and a cached chat turn, for a MoE Qwen3.5 and a Qwen3-Next
tiny checkpoint. The chat's requests reach the second process only through rank 0's broadcast (LockstepEngine).

The processes always stop: bounded waits, killed in `finally`."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen3_5_moe", "qwen3_next")
ENGINE = dict(num_scheduler_steps=4, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128, block_size=16,
              num_gpu_blocks_override=24, max_num_snapshots=8)


def _prompts():
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in (5, 11)]
    return prompts, [rng.integers(3, 500, n).tolist() for n in (20, 12)]


def _offline(llm):
    """Greedy tokens with logprobs (single steps) and plain greedy (several steps per call): every process runs
    these same calls on the same prompts."""
    from qnext import SamplingParams

    prompts, _ = _prompts()
    return (llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)),
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))


def scenario(path, lockstep: bool = False, **engine_options) -> dict:
    """_offline, then a two-turn chat (the second turn cached) stepped by hand; with `lockstep` (rank 0) the chat's
    requests go through LockstepEngine, and the other processes follow (`follower`)."""
    import qnext
    from qnext import SamplingParams
    from qnext.distributed.multiprocess import LockstepEngine

    llm = qnext.LLM(path, **ENGINE, **engine_options)
    with_logprobs, multi = _offline(llm)
    driver = LockstepEngine(llm.engine) if lockstep else llm.engine
    history, cached = [], []
    for turn, message in enumerate(_prompts()[1]):
        history += message
        driver.add_request(f"chat-{turn}", {"prompt_token_ids": list(history)},
                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        done = None
        for _ in range(100):                      # bounded: 5 tokens need a handful of steps
            done = next((o for o in driver.step() if o.finished), None)
            if done is not None:
                break
        cached.append(done.num_cached_tokens)
        history += list(done.outputs[0].token_ids)
    if lockstep:
        driver.shutdown()
    return {"tokens": [list(o.outputs[0].token_ids) for o in with_logprobs],
            "logprobs": [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in with_logprobs],
            "multi": [list(o.outputs[0].token_ids) for o in multi], "chat": history, "cached": cached}


def follower(path, **engine_options) -> dict:
    """Every process but rank 0: the same offline calls, then the steps rank 0's broadcasts ask for."""
    import qnext
    from qnext.distributed.multiprocess import LockstepEngine

    llm = qnext.LLM(path, **ENGINE, **engine_options)
    _offline(llm)
    return {"follower_steps": LockstepEngine(llm.engine).follow()}


_PROCESS = """
import json, sys
from qnext.distributed.multiprocess import DistributedConfig, initialize, is_leader
initialize(DistributedConfig(nnodes=2, node_rank=int(sys.argv[1]), dist_init_addr=sys.argv[2]), timeout_s=120)
from tests.engine.test_multiprocess import follower, scenario
out = {family: scenario(path, lockstep=True, tensor_parallel_size=4) if is_leader()
       else follower(path, tensor_parallel_size=4) for family, path in json.loads(sys.argv[3]).items()}
print(json.dumps(out), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("multiprocess")
    return {f: str(write_tiny_checkpoint(root / f, f, seed=3, num_hidden_layers=2,
                                         layer_types=["linear_attention", "full_attention"])) for f in FAMILIES}


def test_two_processes_of_two_devices_match_one_device(checkpoints):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=str(ROOT))
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(rank), address, json.dumps(checkpoints)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for rank in (0, 1)]
    try:
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    leader, follower = (json.loads(out.strip().splitlines()[-1]) for out, _ in results)
    for family in FAMILIES:
        one = scenario(checkpoints[family])
        many = leader[family]
        assert many["tokens"] == one["tokens"], family
        np.testing.assert_allclose(np.array(many["logprobs"]), np.array(one["logprobs"]), atol=1e-5, rtol=0)
        assert many["multi"] == one["multi"] == one["tokens"], family
        assert many["chat"] == one["chat"], family
        assert many["cached"] == one["cached"] and one["cached"][1] > 0, (one["cached"], many["cached"])
        assert follower[family]["follower_steps"] > 0


def test_distributed_flags_are_checked():
    from qnext.distributed.multiprocess import DistributedConfig

    with pytest.raises(ValueError, match="nnodes > 1 needs dist_init_addr"):
        DistributedConfig(nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="node_rank must be in \\[0, nnodes=2\\)"):
        DistributedConfig(nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match="host:port"):
        DistributedConfig(nnodes=2, node_rank=0, dist_init_addr="127.0.0.1")
