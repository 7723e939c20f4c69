"""PEFT modules -> the engine's fused weight leaves.

The engine fuses HF linears into one leaf each (docs/CONTRACTS.md): attention q_proj | k_proj | v_proj ->
`qkv_proj` with q_proj's per-head [query | gate] rows split apart; Qwen3-Next's in_proj_qkvz + in_proj_ba (rows
interleaved per key head) or Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a -> `in_proj`; gate_proj |
up_proj -> `gate_up` (dense MLP and shared expert). A leaf fused from n modules gets n * max_lora_rank rank
columns per adapter slot: module i's A fills rank block i (zero-padded to max_lora_rank), and B is block-diagonal,
its rows put in the leaf's row order by the checkpoint loader's own `combine` (applied to row indices), so the
fused delta x A^T B^T equals the modules' deltas placed where the loader places their base rows. Exact: the
padding and off-diagonal blocks are zeros.

Adaptable: every dense linear of attention, DeltaNet, the dense MLP and the shared expert (shared_expert_gate
included). Not adaptable (refused by name): routed experts, the router, embeddings, lm_head.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from qnext.config import ModelConfig
from qnext.lora.peft_format import AdapterError, PeftAdapter
from qnext.model.loader import family_plan

ADAPTABLE_LEAVES = ("qkv_proj", "o_proj", "in_proj", "out_proj", "gate_up", "down", "shared_gate_up",
                    "shared_down", "shared_gate")
_REFUSED = (("experts", "routed experts"), ("mlp.gate", "the MoE router"), ("embed_tokens", "embeddings"),
            ("lm_head", "lm_head"), ("conv1d", "the DeltaNet conv (not a linear layer)"))


@dataclasses.dataclass(frozen=True)
class LeafTarget:
    """One fused [out, in] leaf and the HF modules it is made of."""

    path: tuple                            # path in the weights pytree, e.g. ("layers", 0, "attn", "in_proj")
    modules: tuple[str, ...]               # HF module names, in the loader's source order
    module_rows: tuple[int, ...]           # each module's output rows
    in_features: int
    row_order: np.ndarray                  # [out] leaf row j is row row_order[j] of the modules' stacked rows

    @property
    def out_features(self) -> int:
        return len(self.row_order)


def leaf_targets(cfg: ModelConfig) -> list[LeafTarget]:
    """Every adaptable leaf of cfg's model."""
    plan = family_plan(cfg)
    out, orders = [], {}
    for i, layer in enumerate(plan["layers"]):
        for part in ("attn", "mlp"):
            for key, leaf in layer[part].items():
                if key not in ADAPTABLE_LEAVES:
                    continue
                names = tuple(name[:-len(".weight")] for name, _ in leaf.sources)
                rows = tuple(shape[0] for _, shape in leaf.sources)
                kind = (key, tuple(shape for _, shape in leaf.sources))
                if kind not in orders:       # the same for every layer of a kind: computed once
                    orders[kind] = _row_order(leaf, [shape for _, shape in leaf.sources])
                out.append(LeafTarget(("layers", i, part, key), names, rows, leaf.sources[0][1][1], orders[kind]))
    return out


def _row_order(leaf, shapes) -> np.ndarray:
    """Where the loader's combine puts each source row: combine applied to arrays holding their row indices."""
    start = np.cumsum([0] + [s[0] for s in shapes])
    marks = [np.broadcast_to(np.arange(lo, lo + s[0], dtype=np.int64)[:, None], s) for lo, s in zip(start, shapes)]
    combined = np.asarray(leaf.combine(*marks))
    return combined[:, 0].copy()


def check_targets(adapter: PeftAdapter, targets: list[LeafTarget], max_rank: int) -> None:
    """Every module of the adapter is an adaptable linear of this model, with this model's shapes and a rank within
    max_rank; every name in a target_modules list names a module of this model. AdapterError otherwise."""
    known = {m: (t, j) for t in targets for j, m in enumerate(t.modules)}
    for name, m in adapter.modules.items():
        if name not in known:
            what = next((w for pat, w in _REFUSED if pat in name), None)
            raise AdapterError(f"adapter {adapter.path}: module {name!r} " + (
                f"is {what}; LoRA on {what} is not supported" if what else "is not a linear layer of this model"))
        t, j = known[name]
        if m.rank > max_rank:
            raise AdapterError(f"adapter {adapter.path}: module {name!r} has rank {m.rank}, above max_lora_rank "
                               f"{max_rank}")
        want_a, want_b = (m.rank, t.in_features), (t.module_rows[j], m.rank)
        if m.a.shape != want_a or m.b.shape != want_b:
            raise AdapterError(f"adapter {adapter.path}: module {name!r} has lora_A {m.a.shape} and lora_B "
                               f"{m.b.shape}; this model needs {want_a} and {want_b} (an adapter of another base?)")
    if isinstance(adapter.target_modules, tuple):
        for target in adapter.target_modules:
            if not any(name == target or name.endswith("." + target) for name in known):
                what = next((w for pat, w in _REFUSED if pat.split(".")[-1] == target or target in pat), None)
                raise AdapterError(f"adapter {adapter.path}: target module {target!r} " + (
                    f"is {what}; LoRA on {what} is not supported" if what else "is not a linear layer of this model"))
    elif isinstance(adapter.target_modules, str) and adapter.target_modules != "all-linear":
        vlm = ("model.language_model." + name[len("model."):] for name in known)   # the VLM wrapper's names
        if not any(re.fullmatch(adapter.target_modules, name) for name in (*known, *vlm)):
            raise AdapterError(f"adapter {adapter.path}: target_modules regex {adapter.target_modules!r} matches no "
                               "linear layer of this model")


def fused_leaf(adapter: PeftAdapter, t: LeafTarget, max_rank: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(A [n*max_rank, in], B [out, n*max_rank] with the scaling folded in) for leaf t, or None when the adapter
    has none of its modules."""
    if not any(m in adapter.modules for m in t.modules):
        return None
    n = len(t.modules)
    a = np.zeros((n * max_rank, t.in_features), np.float32)
    b = np.zeros((sum(t.module_rows), n * max_rank), np.float32)
    row = 0
    for j, (name, rows) in enumerate(zip(t.modules, t.module_rows)):
        m = adapter.modules.get(name)
        if m is not None:
            a[j * max_rank:j * max_rank + m.rank] = m.a
            b[row:row + rows, j * max_rank:j * max_rank + m.rank] = m.b * np.float32(m.scaling)
        row += rows
    return a, b[t.row_order]
