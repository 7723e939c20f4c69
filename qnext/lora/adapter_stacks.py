"""The adapters on device: per adaptable leaf one A stack [S*R, in] and one B stack [out, S*R] (S = max_loras + 1
slots, R = the leaf's modules times max_lora_rank; qnext/ops/lora_weight.py), slot 0 all zeros.

Loading an adapter into a slot writes that slot's columns of every stack in one jitted call with the stacks
donated (compiled once: the slot is a traced index), so nothing of the step recompiles. Leaves the adapter does
not touch get zeros in that slot.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnext.config import ModelConfig
from qnext.lora.adapter_weights import check_targets, fused_leaf, leaf_targets
from qnext.lora.peft_format import AdapterError, PeftAdapter
from qnext.ops.lora_weight import LoraWeight


class AdapterStacks:
    def __init__(self, cfg: ModelConfig, dtype: Any, max_loras: int, max_lora_rank: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {max_lora_rank}")
        self.max_loras, self.max_lora_rank, self.dtype = max_loras, max_lora_rank, dtype
        self.targets = leaf_targets(cfg)
        s = self.num_slots
        self.stacks = {t.path: (jnp.zeros((s * self._rank(t), t.in_features), dtype),
                                jnp.zeros((t.out_features, s * self._rank(t)), dtype)) for t in self.targets}

    @property
    def num_slots(self) -> int:
        return self.max_loras + 1

    def _rank(self, t) -> int:
        return len(t.modules) * self.max_lora_rank

    def check(self, adapter: PeftAdapter) -> None:
        check_targets(adapter, self.targets, self.max_lora_rank)

    def write(self, slot: int, adapter: PeftAdapter | None) -> None:
        """Puts `adapter` (None: zeros) into slot 1..max_loras."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"adapter slot {slot} is outside 1..max_loras ({self.max_loras})")
        if adapter is not None:
            self.check(adapter)
        new = {}
        for t in self.targets:
            r = self._rank(t)
            ab = fused_leaf(adapter, t, self.max_lora_rank) if adapter is not None else None
            if ab is None:
                ab = (np.zeros((r, t.in_features), np.float32), np.zeros((t.out_features, r), np.float32))
            new[t.path] = tuple(x.astype(self.dtype) for x in ab)
        self.stacks = _write_slot(self.stacks, new, jnp.int32(slot))

    def attach(self, params: dict) -> dict:
        """params with each adaptable leaf w replaced by LoraWeight(w, A, B) (no slots bound: the step binds
        them). The result shares every array with `params` and the stacks."""
        layers = [dict(layer, attn=dict(layer["attn"]), mlp=dict(layer["mlp"])) for layer in params["layers"]]
        for path, (a, b) in self.stacks.items():
            _, i, part, key = path
            if key not in layers[i][part]:
                raise AdapterError(f"the model has no weight {path}")
            layers[i][part][key] = LoraWeight(layers[i][part][key], a, b, self.num_slots)
        return dict(params, layers=tuple(layers))


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_slot(stacks, new, slot):
    """stacks {path: (A [S*R, in], B [out, S*R])}; new {path: (A [R, in], B [out, R])}: slot's rows / columns."""
    def put(ab, nab):
        (a, b), (na, nb) = ab, nab
        r = na.shape[0]
        return (jax.lax.dynamic_update_slice(a, na, (slot * r, 0)),
                jax.lax.dynamic_update_slice(b, nb, (0, slot * r)))
    return {path: put(stacks[path], new[path]) for path in stacks}
