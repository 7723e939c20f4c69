"""A dense weight with a stack of LoRA adapters beside it: each row of x adds the delta of its own adapter slot.

Layout (qnext/lora/adapter_stacks.py fills it; docs/lora.md): S = max_loras + 1 slots of R rank columns each.
    a [S*R, in]   slot s's A (the PEFT lora_A rows, zero-padded to R) at rows [s*R, (s+1)*R)
    b [out, S*R]  slot s's B (PEFT lora_B times its scaling alpha/r or alpha/sqrt(r)) at columns [s*R, (s+1)*R)
Slot 0 holds zeros: a row without an adapter gets the base projection plus exactly 0.

The delta is one dense matmul over all slots, then the row's own slot kept and the others zeroed, then one dense
matmul back ("masked all-slot" form): y = x W^T + mask_s(x A^T) B^T. Its cost grows with S*R (the rank of all
slots together), which stays far below `in` for the slot counts an engine keeps on device (S*R = 5*16 = 80
against in = 2048); it needs no gather of a per-row [R, in] matrix (T*R*in bytes at prefill sizes) and no sort, and
any mix of slots runs in one compiled shape. `slots` is bound inside the step (bind_lora_slots) from the step's
per-token slot ids; it is None in the weights an engine holds.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    base: Any                          # [out, in] (an array or an Fp8Weight)
    a: jax.Array                       # [S*R, in]
    b: jax.Array                       # [out, S*R]
    num_slots: int = dataclasses.field(metadata=dict(static=True))
    slots: jax.Array | None = None     # [...] int32: the slot of each row of x (x.shape[:-1])

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def rank_per_slot(self) -> int:
        return self.a.shape[0] // self.num_slots


def lora_delta(x, w: LoraWeight, linear_fn):
    """x [..., in] -> [..., out]: each row's own slot's x A^T B^T (zero for slot 0)."""
    if w.slots is None:
        raise ValueError("a LoRA weight was used without per-row slots; bind them with bind_lora_slots first")
    lead, s, r = x.shape[:-1], w.num_slots, w.rank_per_slot
    slots = jnp.broadcast_to(w.slots, lead)
    xa = linear_fn(x, w.a.astype(x.dtype)).reshape(lead + (s, r))          # [..., S, R]
    keep = slots[..., None, None] == jnp.arange(s)[:, None]                # [..., S, 1]
    xa = jnp.where(keep, xa, 0).reshape(lead + (s * r,))
    return linear_fn(xa, w.b.astype(x.dtype))


def bind_lora_slots(params, slots):
    """Every LoraWeight leaf of `params` with `slots` ([T] int32, one per flat token) as its rows' slots."""
    return jax.tree.map(lambda w: dataclasses.replace(w, slots=slots) if isinstance(w, LoraWeight) else w, params,
                        is_leaf=lambda w: isinstance(w, LoraWeight))
