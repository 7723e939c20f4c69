"""A 131,136-token prompt on a tiny model, chunked prefill end to end (attention over 128k cached tokens in chunks,
the delta rule's chunked prefill at that length): two chunkings give the same tokens and logprobs, and turn 2 (the
prompt, the reply and a question) reuses everything but the last block.

Slow (minutes on 2 cores: attention's cost is quadratic in the length); the model's attention is shrunk to 2 heads
of 16 dims so the quadratic part stays affordable. scripts/long_session.py measures 8k to 256k."""
from __future__ import annotations

import numpy as np
import pytest

import qnext
from qnext import SamplingParams

LENGTH = 131_072 + 64
BLOCK = 16


@pytest.mark.slow
def test_128k_prompt_chunked_two_ways_and_turn_two_reuse(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5", max_position_embeddings=LENGTH + 256, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16)
    prompt = np.random.default_rng(0).integers(3, 500, LENGTH).tolist()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    results = []
    for chunk in (4096, 3000):                      # 3000: chunks cut off block boundaries too
        llm = qnext.LLM(path, max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=LENGTH + 256,
                        block_size=BLOCK)
        first = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        results.append(first)
        if chunk == 4096:
            question = np.random.default_rng(1).integers(3, 500, 40).tolist()
            turn2 = prompt + list(first.outputs[0].token_ids) + question
            second = llm.generate([{"prompt_token_ids": turn2}], params)[0]
            assert second.num_cached_tokens >= len(turn2) - len(question) - BLOCK, second.num_cached_tokens
            assert llm.engine.cache_stats.lost_to_missing_state_tokens == 0
        llm.close()
    a, b = (r.outputs[0] for r in results)
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)],
                               [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)], atol=1e-4)
