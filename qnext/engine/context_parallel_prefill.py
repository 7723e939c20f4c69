"""Context-parallel prefill in the engine (EngineConfig.context_parallel_size = n > 1): a step whose only work is
one long prompt chunk runs over n devices (qnext/model/context_parallel_step.py); every other step runs as usual,
on the same replicated params and cache buffers (each device computing it whole). docs/long-context.md."""
from __future__ import annotations

from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.engine.plan import StepPlan
from qnext.model.buckets import Bucket
from qnext.model.context_parallel_step import make_context_parallel_step, replicated, shard_layout
from qnext.model.step_inputs import Segment


class ContextParallelPrefill:
    def __init__(self, cfg: ModelConfig, config: EngineConfig):
        self.size = config.context_parallel_size
        self.config = config
        self._step = make_context_parallel_step(cfg, self.size)
        self.steps = 0                       # steps run split (the others ran whole)

    def place(self, params):
        """The params whole on each of the n devices."""
        return replicated(params, self.size)

    def run(self, params, plan: StepPlan):
        """(logits [1, V], greedy [1], buffers) of a plan it can split: one prefilling sequence of at least n x the
        prefill chunk tokens, no pictures, no per-token logits; None for any other plan (the caller runs it whole)."""
        if plan.multi is not None or len(plan.items) != 1 or plan.items[0].seq.visuals is not None:
            return None
        layout = shard_layout(plan.items[0].segment, self.size, plan.bucket.sizes, block_size=self.config.block_size,
                              chunk=plan.bucket.chunk, extra_groups=self.config.max_prefill_groups_extra)
        if layout is None:
            return None
        self.steps += 1
        return self._step(params, plan.buffers, *layout)

    def warm_up(self, params, buffers, bucket: Bucket):
        """Compiles the split step of a bucket that can hold one (its layout depends on the bucket only) on a
        padding segment that writes nothing but the dummy block and row; returns the buffers."""
        tokens = self.size * bucket.chunk
        if not bucket.sizes.num_chunks or bucket.sizes.num_tokens < tokens:
            return buffers
        blocks = -(-tokens // self.config.block_size)
        layout = shard_layout(Segment([0] * tokens, 0, [0] * blocks, -1, 0), self.size, bucket.sizes,
                              block_size=self.config.block_size, chunk=bucket.chunk,
                              extra_groups=self.config.max_prefill_groups_extra)
        return buffers if layout is None else self._step(params, buffers, *layout)[2]
