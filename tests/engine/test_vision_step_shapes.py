"""With a vision tower, warm-up compiles every step shape a picture can need (one more per bucket, qnext/engine/
visual_encoder.py): serving pictures afterwards compiles no step. A compile on first use ran on the engine thread
and held every request (20-30 s a shape on a loaded 2-core CPU; the API fuzzing saw streams stall for minutes)."""
from __future__ import annotations

import qnext
from qnext import SamplingParams
from qnext.testing.tiny_tokenizer import tiny_vision_token_ids
from tests.support.vision_checkpoint import picture, write_vision_checkpoint

ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=160, block_size=16,
              num_gpu_blocks_override=32, max_num_snapshots=8)
VS, VE, PAD = (tiny_vision_token_ids()[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id"))


def image_prompt(text: list[int], images: list, tokens_per_image: int) -> dict:
    ids = list(text)
    for _ in images:
        ids += [VS] + [PAD] * tokens_per_image + [VE] + [5, 6]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def test_after_warm_up_pictures_compile_no_step(tmp_path):
    llm = qnext.LLM(write_vision_checkpoint(tmp_path / "vlm", seed=3), **ENGINE)
    assert llm.engine.warm_up() == 2 * len(llm.engine.runner.buckets.all)
    step = llm.engine.runner._step
    compiled = step._cache_size()
    assert compiled == llm.engine.num_step_shapes
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [image_prompt([7, 8, 9], [picture(1)], 16),                     # visual rows in one prefill step
               {"prompt_token_ids": list(range(20, 45))},                     # text beside pictures (mixed steps)
               image_prompt([10, 11], [picture(2, 64, 64)], 64),              # split over prefill steps
               image_prompt([12], [picture(3), picture(4)], 16)]      # two pictures
    outs = llm.generate(prompts, greedy)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5] * 4
    assert llm.engine.stats.num_tower_runs >= 4
    assert step._cache_size() == compiled, "a picture step compiled a shape the warm-up did not"
