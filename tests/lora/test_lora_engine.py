"""Many adapters in one step: a mixed batch gives each row what it gives alone; the prefix cache keys on the
adapter's weights digest."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("peft")

import qnext  # noqa: E402
from qnext.lora.scoring import with_adapter  # noqa: E402
from tests.support.peft_reference import TARGETS, make_adapter  # noqa: E402

PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(3, 500, 20 + 7 * i)] for i in range(5)]
GREEDY = qnext.SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    base = tiny_checkpoint("qwen3_5")
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    adapters = []
    for i in range(4):
        make_adapter(hf, root / f"a{i}", TARGETS["qwen3_5"], seed=i, scale=0.15)
        adapters.append(qnext.LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    llm = qnext.LLM(base, enable_lora=True, max_loras=4, max_lora_rank=8, max_num_seqs=8,
                    max_num_batched_tokens=256)
    yield base, adapters, llm, root, hf
    llm.close()


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_mixed_batch_gives_each_row_what_it_gives_alone(setup):
    base, adapters, llm, _, _ = setup
    loras = adapters + [None]                     # four adapters and the base, one step
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    mixed = _tokens(llm.generate(prompts, GREEDY, lora_request=loras))
    alone = [_tokens(llm.generate([p], GREEDY, lora_request=[lora]))[0] for p, lora in zip(prompts, loras)]
    assert mixed == alone
    base_only = _tokens(llm.generate(prompts, GREEDY))
    assert mixed[4] == base_only[4]
    assert sum(m != b for m, b in zip(mixed[:4], base_only[:4])) >= 3, "the adapters barely change the outputs"
    # the engine's first token is the argmax of the PEFT-exact scoring path with that adapter
    model = qnext.load_model(base)
    for p, lora, toks in zip(PROMPTS[:4], adapters, mixed):
        assert toks[0] == int(np.argmax(with_adapter(model, lora.lora_path).logits(p)[-1]))


def test_prefix_cache_keys_on_the_adapter_weights(setup):
    """Same adapter: the prefix is shared. Another adapter, or the base, or the same name and id re-saved with new
    weights: nothing is shared (each would serve another model's KV and states if the digest left the keys)."""
    base, adapters, llm, root, hf = setup
    prompt = {"prompt_token_ids": [int(t) for t in np.random.default_rng(9).integers(3, 500, 70)]}
    first = llm.generate(prompt, GREEDY, lora_request=adapters[0])[0]
    again = llm.generate(prompt, GREEDY, lora_request=adapters[0])[0]
    assert again.num_cached_tokens >= 48 and _tokens([again]) == _tokens([first])
    assert llm.generate(prompt, GREEDY, lora_request=adapters[1])[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0

    reloaded = qnext.LoRARequest("a0", 1, str(root / "a0"))     # same name, id and path; new weights
    import time
    time.sleep(0.01)
    make_adapter(hf, root / "a0", TARGETS["qwen3_5"], seed=40, scale=0.15)
    out = llm.generate(prompt, GREEDY, lora_request=reloaded)[0]
    assert out.num_cached_tokens == 0
    model = qnext.load_model(base)
    assert out.outputs[0].token_ids[0] == int(np.argmax(with_adapter(model, root / "a0").logits(
        prompt["prompt_token_ids"])[-1]))
