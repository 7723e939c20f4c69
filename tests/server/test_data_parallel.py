"""Data parallelism in the server (qnext/server/data_parallel.py): the router sends a chat's next turn to the replica
holding its prefix, otherwise to the least loaded; a full replica passes requests on; /metrics per replica."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.hashing import block_hashes
from cache.image_keys import ImageSpan
from qnext.served_engine import ServedModel
from qnext.server.data_parallel import prompt_chain
from qnext.server.prefix_affinity import PrefixAffinity

MODEL = ServedModel(None, max_model_len=128, vocab_size=512, block_size=4, num_blocks=100)


def chain(token_ids, images=()):
    return prompt_chain(MODEL, token_ids, images)


def test_cache_aware_routing_prefers_the_longest_prefix_then_the_least_loaded():
    loads = [0, 0]
    router = PrefixAffinity(2, capacity_keys=100, load_of=lambda i: loads[i])
    chat = list(range(10, 30))
    assert router.order(chain(chat))[0] == 0             # nothing cached, equal loads: the first
    router.sent(0, chain(chat))
    loads[0] = 5                                         # busier, but it holds the prefix
    assert router.order(chain(chat + [7, 8, 9, 10]))[0] == 0
    assert router.order(chain(list(range(100, 120))))[0] == 1   # no match anywhere: the least loaded
    router.record(1, chain(chat[:8]))
    assert router.matched(1, block_hashes(chat, 4)) == 2
    assert router.order(chain(chat))[0] == 0             # 5 blocks beat 2


def test_with_no_prefix_held_and_equal_loads_the_replica_chosen_least_recently_goes_first():
    router = PrefixAffinity(2, capacity_keys=100)
    first = router.order(chain(list(range(8))))[0]
    router.sent(first, chain(list(range(8))))
    assert router.order(chain(list(range(50, 58))))[0] == 1 - first
    assert router.order(chain(list(range(8)) + [1, 2, 3, 4]))[0] == first        # a held prefix still comes first


def test_router_forgets_the_least_recently_sent_blocks_beyond_the_replica_capacity():
    router = PrefixAffinity(2, capacity_keys=3)
    old, new = list(range(12)), list(range(50, 62))
    router.record(0, chain(old))
    router.record(0, chain(new))
    assert router.matched(0, block_hashes(old, 4)) == 0 and router.matched(0, block_hashes(new, 4)) == 3


def test_router_keys_a_pictures_blocks_on_the_picture():
    """Equal token ids with another picture share only the blocks before the picture, as in the engine's cache."""
    router = PrefixAffinity(2, capacity_keys=100)
    ids = list(range(10, 18)) + [99] * 8 + [20, 21, 22, 23]         # the picture's pads fill blocks 2 and 3
    one, other = ImageSpan(8, 8, bytes(32)), ImageSpan(8, 8, bytes(31) + b"\1")
    router.record(0, chain(ids, [one]))
    assert router.matched(0, block_hashes(ids, 4, images=[one])) == 5
    assert router.matched(0, block_hashes(ids, 4, images=[other])) == 2
    router.record(1, chain(ids, [other]))
    assert router.order(chain(ids, [one]))[0] == 0 and router.order(chain(ids, [other]))[0] == 1


def test_router_keys_a_lora_adapters_blocks_on_its_weights(tiny_checkpoint, tmp_path):
    """Equal prompts of different adapters (or an adapter and the base) share no block, as in the engine's cache;
    the root is the adapter's weights digest's, so an adapter saved again with new weights starts afresh."""
    from qnext.lora import LoRARequest, read_peft_adapter
    from qnext.lora.identity import adapter_hash_root, hash_root
    from qnext.testing.tiny_adapter import write_tiny_adapter

    ckpt = tiny_checkpoint("qwen3_5")
    a, b = (LoRARequest(n, i + 1, str(write_tiny_adapter(tmp_path / n, ckpt, seed=i))) for i, n in enumerate("ab"))
    root_a, root_b = adapter_hash_root(a), adapter_hash_root(b)
    assert root_a == hash_root(read_peft_adapter(a.lora_path).digest) and root_a != root_b
    router = PrefixAffinity(2, capacity_keys=100)
    ids = list(range(10, 30))
    router.record(1, prompt_chain(MODEL, ids, root=root_a))
    assert router.order(prompt_chain(MODEL, ids, root=root_a))[0] == 1
    assert router.matched(0, prompt_chain(MODEL, ids, root=root_a)) == 0
    assert router.matched(1, prompt_chain(MODEL, ids, root=root_b)) == 0          # another adapter: no match
    assert router.matched(1, chain(ids)) == 0                                       # the base: no match
    import time
    time.sleep(0.01)
    write_tiny_adapter(tmp_path / "a", ckpt, seed=5)                    # same name, id and path; new weights
    assert adapter_hash_root(a) not in (root_a, root_b)


def test_round_robin_takes_turns_and_bad_policies_are_refused():
    router = PrefixAffinity(3, capacity_keys=10, policy="round_robin")
    assert [router.order(chain([1, 2, 3, 4]))[0] for _ in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="routing policy must be one of"):
        PrefixAffinity(2, capacity_keys=10, policy="random")


def test_two_replicas_serve_a_chat_from_the_cache_and_answer_everything(tiny_checkpoint):
    import qnext
    from qnext import SamplingParams
    from qnext.server.data_parallel import DataParallelEngine

    options = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128, block_size=16,
                   num_gpu_blocks_override=24, max_num_snapshots=8)
    path = tiny_checkpoint("qwen3_5")
    engines = [qnext.LLM(path, **options).engine for _ in range(2)]
    # one waiting request per replica at most: a burst must spill over to the other replica, never fail
    dp = DataParallelEngine.of_threads(engines, max_waiting_requests=1, model_name="tiny", routing="cache_aware")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run(request_id, token_ids):
        for _ in range(200):                       # bounded retries while both queues are full
            try:
                stream = await dp.add(request_id, {"prompt": None, "prompt_token_ids": token_ids}, params)
                break
            except Exception as e:                 # QueueFullError from both replicas
                assert "already waiting" in str(e), e
                await asyncio.sleep(0.05)
        last = None
        async for delta in stream:
            last = delta.output
        return last

    async def scenario():
        dp.start()
        try:
            first = list(rng.integers(3, 500, 40))
            out = await run("turn-1", first)
            second = first + list(out.outputs[0].token_ids) + list(rng.integers(3, 500, 8))
            out2 = await run("turn-2", second)
            burst = await asyncio.gather(*(run(f"b{i}", list(rng.integers(3, 500, 20))) for i in range(6)))
            left = await dp.add("left", {"prompt": None, "prompt_token_ids": first}, params)
            left.close()                           # the client leaves: no on_finish for it
            await run("after", list(rng.integers(3, 500, 20)))
            assert not dp._owner and not dp._images, (dp._owner, dp._images)   # nothing kept per ended request
            return out, out2, burst
        finally:
            dp.stop()

    out, out2, burst = asyncio.run(scenario())
    assert out2.num_cached_tokens >= 32                    # the second turn went where the first one is cached
    assert all(o is not None and o.finished and len(o.outputs[0].token_ids) == 4 for o in burst)
    assert min(dp.routed) >= 1 and sum(dp.routed) == 10, dp.routed
    text = dp.render_metrics().decode()
    assert 'engine="0"' in text and 'engine="1"' in text
    assert text.count("# TYPE qnext:num_requests_running gauge") == 1
