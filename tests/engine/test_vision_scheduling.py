"""The scheduler's plans for prompts with large pictures (no model runs): several 10k-token images under a small
max_num_batched_tokens are split across steps wherever the budget ends, every step plans work until every request
is done (no deadlock, whatever the KV pool holds), and each step's picture tokens stay inside its budget."""
from __future__ import annotations


import numpy as np

from cache import CacheConfig
from qnext.engine.cache_setup import CacheSetup
from qnext.engine.config import EngineConfig
from qnext.engine.engine_cache import EngineCache
from qnext.engine.plan import StepResult
from qnext.engine.sampled_token import SampledToken
from qnext.engine.scheduler import Scheduler
from qnext.engine.sequence import Sequence
from qnext.engine.visual_request import sequence_visuals
from qnext.model.buckets import BucketTable
from qnext.sampling_params import SamplingParams
from qnext.vision.config import VisionTokenIds
from qnext.vision.preprocess import VisualInput

IDS = VisionTokenIds(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
BS, BUDGET, SIDE = 16, 512, 200            # a 200 x 200 patch grid: 100 x 100 merged = 10,000 tokens


def big_image(seed: int) -> VisualInput:
    return VisualInput("image", np.full((SIDE * SIDE, 1), seed, np.float32), (1, SIDE, SIDE), SIDE * SIDE // 4)


def request(index: int, num_images: int) -> Sequence:
    images = [big_image(10 * index + i) for i in range(num_images)]
    ids = [1, 2, 3]
    for image in images:
        ids += [IDS.vision_start_token_id] + [IDS.image_token_id] * image.num_tokens + [IDS.vision_end_token_id, 7]
    seq = Sequence(f"r{index}", ids, SamplingParams(max_tokens=2, ignore_eos=True), index)
    seq.visuals = sequence_visuals(ids, images, IDS, spatial_merge_size=2)
    return seq


def scheduler(num_blocks: int) -> Scheduler:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET, block_size=BS, max_model_len=32768)
    buckets = BucketTable(max_num_seqs=4, max_num_batched_tokens=BUDGET, max_blocks=32768 // BS, prefill_chunk=32,
                          max_prefill_groups_extra=8)
    cache = EngineCache(CacheSetup(CacheConfig(block_size=BS, num_blocks=num_blocks, num_live_slots=4,
                                               num_snapshot_slots=8), buffers=object()), host_buffers=None)
    return Scheduler(config, cache, buckets, eos_token_ids=[0], vocab_size=1024, max_model_len=32768)


def run_to_completion(sched: Scheduler, seqs: list[Sequence], max_steps: int = 400) -> int:
    for seq in seqs:
        sched.add(seq)
    steps = 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None, f"nothing planned at step {steps} with {len(sched.waiting)} waiting: a deadlock"
        assert sum(it.end - it.start for it in plan.items) <= BUDGET
        sampled = {it.seq.request_id: SampledToken(9, 0.0, 1, None, None) for it in plan.items if it.samples}
        sched.postprocess(plan, StepResult(plan.buffers, sampled))
        steps += 1
        assert steps < max_steps
    return steps


def test_several_10k_token_images_under_a_small_budget_finish():
    seqs = [request(i, num_images=2) for i in range(3)]           # 3 x 20,009 prompt tokens
    steps = run_to_completion(scheduler(num_blocks=4 * 1300), seqs)
    prompt_tokens = sum(len(s.prompt_token_ids) for s in seqs)
    assert steps >= prompt_tokens // BUDGET                        # the pictures were split across many steps
    assert all(len(s.output_token_ids) == 2 for s in seqs)


def test_a_pool_that_holds_one_request_at_a_time_still_finishes_them_all():
    seqs = [request(i, num_images=2) for i in range(3)]
    run_to_completion(scheduler(num_blocks=1300), seqs, max_steps=600)   # ~1,252 blocks a request
    assert all(len(s.output_token_ids) == 2 for s in seqs)
