"""The vision tower ahead of prefill: a step's image and video pad tokens get the tower's output, its tokens of a
sequence with pictures get their 3-D MRoPE positions (StepInputs' visual fields, qnext/model/visual_inputs.py).

The tower runs once per picture, the first time a step needs any of its tokens; its output is kept in the
encoder cache by content hash (cache/encoder_cache.py), so a later chunk of the same prompt, a prefix-cache hit that
ends inside the picture, and the next chat turn sending it again read it back instead. A step with no sequence
with pictures is laid out exactly as without a tower (nothing of this runs for text-only traffic).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from cache.encoder_cache import EncoderCache
from qnext.engine.plan import ScheduledSequence
from qnext.engine.stats import EngineStats
from qnext.model.step_inputs import StepInputs
from qnext.model.visual_inputs import with_visual_inputs
from qnext.vision.config import VisionConfig, VisionTokenIds
from qnext.vision.preprocess import VisualInput
from qnext.vision.preprocess_config import VisionPreprocessConfig
from qnext.vision.tower import make_encode

MIN_VISUAL_ROWS = 16       # visual rows of a step are padded to a power of two at least this (one compile each)


@dataclasses.dataclass(frozen=True)
class VisionSetup:
    """What a checkpoint with a tower brings: its config, token ids, preprocessing and placed params."""
    config: VisionConfig
    token_ids: VisionTokenIds
    image_preprocess: VisionPreprocessConfig
    video_preprocess: VisionPreprocessConfig
    params: object


class VisualEncoder:
    def __init__(self, setup: VisionSetup, encoder_cache_bytes: int, stats: EngineStats):
        """stats: the engine's counters, where the tower runs, their time and the encoder cache's hits go."""
        self.setup = setup
        self.cache = EncoderCache(encoder_cache_bytes)
        self.stats = stats
        self._encode = make_encode(setup.config)

    def use_weights(self, setup: VisionSetup) -> None:
        """The tower's weights from now on (update_weights); every cached output came from the old ones: dropped."""
        self.setup = setup
        self.cache.clear()

    def embeddings(self, item: VisualInput):
        """[num_tokens, text hidden] tower output of one picture: from the encoder cache, or the tower now."""
        key = bytes.fromhex(item.content_hash)
        out = self.cache.get(key)
        if out is not None:
            self.stats.num_encoder_cache_hits += 1
        else:
            t0 = time.perf_counter()
            out = jax.block_until_ready(self._encode(self.setup.params, jnp.asarray(item.pixel_values),
                                                     item.grid_thw))
            self.stats.tower_seconds += time.perf_counter() - t0
            self.stats.num_tower_runs += 1
            self.cache.put(key, out, int(out.size * out.dtype.itemsize))
        return out

    def attach(self, items: list[ScheduledSequence], inputs: StepInputs) -> StepInputs:
        """inputs with the visual fields of the step's sequences with pictures (unchanged when it has none)."""
        if not any(it.seq.visuals is not None for it in items):
            return inputs
        t = inputs.token_ids.shape[0]
        rope = np.broadcast_to(np.asarray(inputs.positions, np.int32), (3, t)).copy()
        rows, index = [], []
        flat = 0
        for it in items:
            visuals, start, end = it.seq.visuals, it.start, it.end
            if visuals is not None:
                rope[:, flat:flat + end - start] = visuals.rope_positions(start, end)
                for run in visuals.runs:
                    lo, hi = max(start, run.start), min(end, run.start + run.length)
                    if lo >= hi:
                        continue
                    out = self.embeddings(visuals.inputs[run.input_index])
                    first = run.embed_offset + lo - run.start
                    rows.append(out[first:first + hi - lo])
                    index.append(np.arange(flat + lo - start, flat + hi - start, dtype=np.int32))
            flat += end - start
        if not rows:
            return with_visual_inputs(inputs, rope_positions=rope)
        embeds = jnp.concatenate(rows) if len(rows) > 1 else rows[0]
        n = embeds.shape[0]
        self.stats.num_visual_tokens += n
        bucket = max(MIN_VISUAL_ROWS, 1 << (n - 1).bit_length())
        return with_visual_inputs(inputs, rope_positions=rope, visual_embeds=embeds,
                                  visual_token_index=np.concatenate(index), num_visual_rows=bucket)
