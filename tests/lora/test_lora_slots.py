"""Device slots and host memory: a request whose adapter finds every slot held waits in the queue (it is not
refused) while the others run; adapters beyond the slots stay in host memory up to max_cpu_loras (LRU)."""
from __future__ import annotations

import numpy as np
import pytest

import qnext
from qnext.testing.tiny_adapter import write_tiny_adapter

PROMPTS = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(i).integers(3, 500, 12 + 5 * i)]}
           for i in range(4)]
GREEDY = qnext.SamplingParams(max_tokens=5, temperature=0.0)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("qwen3_5")
    root = tmp_path_factory.mktemp("adapters")
    adapters = [qnext.LoRARequest(f"a{i}", i + 1, str(write_tiny_adapter(root / f"a{i}", base, seed=i)))
                for i in range(3)]
    llm = qnext.LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=4, max_num_seqs=4,
                    max_num_batched_tokens=128)
    yield adapters, llm
    llm.close()


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_request_waits_for_a_slot_instead_of_being_refused(setup):
    adapters, llm = setup
    loras = [adapters[0], adapters[1], adapters[0], None]      # two adapters, one slot: a1 waits for a0's rows
    together = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras))
    alone = [_tokens(llm.generate([p], GREEDY, lora_request=[lora]))[0] for p, lora in zip(PROMPTS, loras)]
    assert together == alone
    assert together[1] != _tokens(llm.generate([PROMPTS[1]], GREEDY, lora_request=[adapters[0]]))[0]


def test_host_memory_keeps_max_cpu_loras_adapters_least_recently_used_first(setup):
    adapters, llm = setup
    registry = llm.engine.lora
    registry._host.clear()
    reads = registry.num_disk_reads

    def run(i):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=adapters[i])
        return registry.num_disk_reads - reads

    assert run(0) == 1 and run(1) == 2 and run(0) == 2      # a0 came back to the slot from host memory
    assert run(2) == 3          # over max_cpu_loras=2: a1, the least recently used one, leaves host memory
    assert run(0) == 3          # a0 is still there
    assert run(1) == 4          # a1 is read from disk again
    assert len(registry._host) == 2


def test_max_cpu_loras_below_max_loras_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer of at least max_loras"):
        qnext.engine.config.EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
