"""The vision tower ahead of prefill: a step's image and video pad tokens get the tower's output, its tokens of a
sequence with pictures get their 3-D MRoPE positions (StepInputs' visual fields, qnext/model/visual_inputs.py).

The tower runs once per picture, the first time a step needs any of its tokens; its output is kept in the
encoder cache by content hash (cache/encoder_cache.py), so a later chunk of the same prompt, a prefix-cache hit that
ends inside the picture, and the next chat turn sending it again read it back instead. A step with no sequence
with pictures is laid out exactly as without a tower (nothing of this runs for text-only traffic).

Step shapes: a step with a sequence with pictures always carries [3, T] MRoPE positions and T visual rows (T: the
step shape's flat tokens, so every count of visual tokens fits; unused rows are dropped by the scatter), whether
or not this step holds any of its pad tokens. So pictures add exactly one shape per step shape, which the warm-up
compiles (`placeholder`): a picture never compiles the step while serving. (Padding the rows to a power of two of
the visual tokens made every step shape x rows bucket x with/without rows a shape of its own, each compiled on
first use on the engine thread: 20-30 s each on a loaded 2-core CPU, while every request waited.) The tower itself
still compiles once per distinct set of picture grids (qnext/vision/tower.py).
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

    def attach(self, items: list[ScheduledSequence], inputs: StepInputs, embeds: bool = True) -> StepInputs:
        """inputs with the visual fields of the step's sequences with pictures (unchanged when it has none).
        embeds=False: MRoPE positions only (a decode window, whose tokens are never pad tokens)."""
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
        if not embeds:
            return with_visual_inputs(inputs, rope_positions=rope)
        if not rows:
            return self.placeholder(inputs, rope)
        visual = jnp.concatenate(rows) if len(rows) > 1 else rows[0]
        self.stats.num_visual_tokens += visual.shape[0]
        inputs = with_visual_inputs(inputs, rope_positions=rope, visual_embeds=visual.astype(self.embed_dtype),
                                    visual_token_index=np.concatenate(index), num_visual_rows=t)
        return inputs.replace(visual_embeds=self._placed(inputs.visual_embeds))

    @property
    def embed_dtype(self):
        """The tower's output dtype (its params'): the step's visual rows always have it."""
        return self.setup.params["pos_embed"].dtype

    def _placed(self, rows):
        """The visual rows on the tower params' devices (committed): an array's placement is part of the step's
        compiled signature, so the warm-up's zeros and the tower's output must agree on it."""
        return jax.device_put(rows, self.setup.params["pos_embed"].sharding)

    def placeholder(self, inputs: StepInputs, rope=None) -> StepInputs:
        """inputs in a picture step's shape with nothing visual in it (T zero rows, every one dropped; text
        positions on all three MRoPE axes unless `rope` is given): what the warm-up compiles, and a step whose
        sequences with pictures hold none of their pad tokens."""
        t = inputs.token_ids.shape[0]
        rope = np.broadcast_to(np.asarray(inputs.positions, np.int32), (3, t)) if rope is None else rope
        zeros = self._placed(jnp.zeros((t, self.setup.config.out_hidden_size), self.embed_dtype))
        return inputs.replace(rope_positions=np.array(rope, np.int32), visual_embeds=zeros,
                              visual_token_index=np.full(t, t, np.int32))
