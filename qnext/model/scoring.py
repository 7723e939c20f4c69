"""`load_model(path).logits(token_ids)`: full-prompt scoring through the engine's own step function."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from qnext.config import ModelConfig
from qnext.model.buckets import scoring_sizes
from qnext.model.cache_layout import model_cache_buffers
from qnext.model.checkpoint import load_checkpoint
from qnext.model.forward import make_step
from qnext.model.step_inputs import Segment, build_step_inputs
from qnext.model.visual_inputs import with_visual_inputs
from qnext.model.weights import as_dtype

SCORING_BLOCK_SIZE = 16
SCORING_CHUNK = 64


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: dict
    dtype: np.dtype
    kv_cache_dtype: str = "auto"   # "fp8": the step writes and reads e4m3 KV pages, as an engine with that option
    lora_slot: int | None = None   # params hold LoRA stacks (qnext/lora): every token uses this adapter slot

    def __post_init__(self):
        self._step = make_step(self.config)

    def vocab_check(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids, np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("token_ids is empty")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def logits(self, token_ids, rope_positions=None, visual_embeds=None, visual_token_index=None) -> np.ndarray:
        """Logits [len(token_ids), vocab_size] (float32) of one sequence, computed in one prefill step. Images and
        video: rope_positions [3, len] (qnext/vision/mrope.py), visual_embeds [N, H] (the tower's output) placed
        at the tokens visual_token_index [N]."""
        ids = self.vocab_check(token_ids)
        n = len(ids)
        sizes = scoring_sizes(n, chunk=SCORING_CHUNK, block_size=SCORING_BLOCK_SIZE)
        buffers = model_cache_buffers(self.config, num_blocks=sizes.max_blocks + 1, block_size=SCORING_BLOCK_SIZE,
                                      num_state_rows=2, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype)
        seg = Segment(token_ids=ids.tolist(), start=0, block_table=list(range(1, sizes.max_blocks + 1)), read_row=-1,
                      write_row=1, all_logits=True, lora_slot=self.lora_slot or 0)
        inputs = build_step_inputs([seg], sizes, block_size=SCORING_BLOCK_SIZE, chunk=SCORING_CHUNK,
                                   with_lora=self.lora_slot is not None)
        if rope_positions is not None or visual_embeds is not None:
            # visual rows padded to the token bucket: one compilation per bucket, whatever the image sizes
            inputs = with_visual_inputs(inputs, rope_positions, visual_embeds, visual_token_index,
                                        num_visual_rows=sizes.num_tokens)
        logits, _ = self._step(self.params, buffers, inputs)
        return np.asarray(logits[:n])


def load_model(path: str | Path, dtype: str = "float32", cache_dir: str | Path | None = None) -> Model:
    """Loads a Hugging Face Qwen3-Next / Qwen3.5 checkpoint directory for scoring."""
    checkpoint = load_checkpoint(path, dtype, cache_dir=cache_dir)
    return Model(config=checkpoint.config, params=checkpoint.params, dtype=as_dtype(dtype))
