"""fp8_weights="keep": an FP8 checkpoint's weights stay e4m3 with their block scales on the device (Fp8Weight) and
the model multiplies them directly. The logits equal the dequantised load's exactly (the same float32 products,
rounded once to the model dtype), for the dense, MoE (fused experts) and Qwen3-Next (packed qkvz, per-expert)
families; the release's bf16 rows fused into in_proj stay bf16; leaves whose rows cannot keep whole blocks are
dequantised; the device bytes shrink; the engine's whole step lowers for CUDA with the e4m3 weights as its parameters."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig, resolved_fp8_weights
from qnext.model.dense import dense_forward
from qnext.model.fp8_blocks import dequantize, quantize
from qnext.model.fp8_keep import kept_rows
from qnext.ops.fp8_weight import Fp8Weight
from qnext.model.loader import convert_checkpoint
from qnext.testing.fp8_export import export_fp8
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

BLOCK = (16, 16)     # tiny dims (64, 32-row heads) are whole blocks of 16; the releases' 128 on their 256-row heads
CASES = {
    "qwen3_5": dict(family="qwen3_5"),
    "qwen3_5_moe": dict(family="qwen3_5_moe", fused_experts=True),
    "qwen3_next": dict(family="qwen3_next"),
}
# what "keep" keeps: every fp8 linear; the DeltaNet in_proj (fp8 q k v z with the release's bf16 decay gates b a,
# Qwen3.5's split or Qwen3-Next's packed qkvz + ba) keeps its fp8 rows and the bf16 rows as its tail
KEPT = {"in_proj", "qkv_proj", "o_proj", "out_proj", "gate_up", "down", "experts_gate_up", "experts_down",
        "shared_gate_up", "shared_down"}
_forward = jax.jit(dense_forward, static_argnums=3)


def _kept_names(params) -> set[str]:
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, Fp8Weight))
    return {str(p[-1].key) for p, leaf in leaves if isinstance(leaf, Fp8Weight)}


def _blocks(layer) -> list[dict]:   # a layer's attn and mlp dicts (not its norms)
    return [v for v in layer.values() if isinstance(v, dict)]


def _nbytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


@pytest.mark.parametrize("name", sorted(CASES))
def test_kept_fp8_weights_give_the_dequantised_logits(tmp_path, name):
    case = dict(CASES[name])
    src = write_tiny_checkpoint(tmp_path / "bf16", case.pop("family"), seed=5, dtype="bfloat16", **case)
    fp8 = export_fp8(src, tmp_path / "fp8", block_size=BLOCK)
    cfg = ModelConfig.from_pretrained(fp8)
    kept = convert_checkpoint(fp8, cfg, "bfloat16", fp8_weights="keep")
    widened = convert_checkpoint(fp8, cfg, "bfloat16", fp8_weights="dequantize")
    names = _kept_names(kept)
    assert names == KEPT & {k for layer in widened["layers"] for part in _blocks(layer) for k in part}, names
    for layer in kept["layers"]:
        if "in_proj" in layer["attn"]:   # the decay-gate rows b | a: bf16, never quantised
            tail = layer["attn"]["in_proj"].tail
            assert tail.dtype == jnp.bfloat16 and tail.shape[0] == 2 * cfg.linear_num_value_heads
        for part in _blocks(layer):
            for key, leaf in part.items():
                if isinstance(leaf, Fp8Weight):
                    assert leaf.q.dtype.name == "float8_e4m3fn" and leaf.scale_inv.dtype == np.float32
                elif key in ("router", "shared_gate"):    # left in bf16 by the release
                    assert leaf.dtype == jnp.bfloat16
    assert not isinstance(kept["lm_head"], Fp8Weight) and kept["embed"].dtype == jnp.bfloat16
    assert _nbytes(kept) < _nbytes(widened)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 24))
    ours = np.asarray(_forward(kept, ids, np.ones_like(ids), cfg), np.float32)
    theirs = np.asarray(_forward(widened, ids, np.ones_like(ids), cfg), np.float32)
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)   # the same products, rounded once either way
    assert np.abs(ours).max() > 0.1


def test_rows_reordered_by_whole_blocks_keep_their_scales_and_a_cut_block_is_refused():
    rng = np.random.default_rng(0)
    a, b = (quantize(rng.standard_normal(s).astype(np.float32) * (j + 1), BLOCK) for j, s in
            enumerate([(32, 48), (16, 48)]))
    swap_halves = lambda x, y: np.concatenate([y, x[16:], x[:16]])  # noqa: E731  whole 16-row blocks moved
    kept = kept_rows([a, b], swap_halves, BLOCK)
    np.testing.assert_array_equal(dequantize(np.asarray(kept.q), kept.scale_inv, BLOCK),
                                  swap_halves(dequantize(*a, BLOCK), dequantize(*b, BLOCK)))
    assert kept_rows([a, b], lambda x, y: np.concatenate([x[8:], y, x[:8]]), BLOCK) is None   # a block cut at 8
    partial = quantize(rng.standard_normal((20, 48)).astype(np.float32), BLOCK)   # ends in a 4-row block
    assert kept_rows([partial, b], lambda x, y: np.concatenate([x, y]), BLOCK) is None
    assert kept_rows([b, partial], lambda x, y: np.concatenate([x, y]), BLOCK) is not None   # partial block last
    gates = (rng.standard_normal((6, 48)).astype(np.float32), None)    # rows the release left in bf16
    with_tail = kept_rows([a, gates], lambda x, y: np.concatenate([x, y]), BLOCK, tail_dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(with_tail.tail), gates[0])
    assert with_tail.shape == (38, 48) and with_tail.q.shape == (32, 48)
    assert kept_rows([gates, a], lambda x, y: np.concatenate([x, y]), BLOCK) is None     # bf16 rows first: no tail


def test_fp8_weights_option_is_checked_and_auto_keeps_on_gpu_only():
    with pytest.raises(ValueError, match="fp8_weights must be"):
        EngineConfig(fp8_weights="e4m3")
    assert resolved_fp8_weights("auto", "gpu") == "keep" and resolved_fp8_weights("auto", "cpu") == "dequantize"
    assert resolved_fp8_weights("keep", "cpu") == "keep"


def test_engine_step_with_kept_fp8_weights_lowers_for_cuda(tmp_path):
    """The whole step (mixed decode + prefill bucket, Triton kernels) with the loaded params' e4m3 leaves as its
    parameters: the fp8 weights reach the GPU program as f8E4M3FN arguments (no bf16 copy passed in)."""
    from qnext.engine.runner import make_engine_step
    from cache.device_buffers import allocate_cache_buffers
    from qnext.model.buckets import BucketTable
    from qnext.model.cache_layout import cache_layout
    from qnext.model.step_inputs import Segment, build_step_inputs

    src = write_tiny_checkpoint(tmp_path / "bf16", "qwen3_5_moe", seed=5, dtype="bfloat16", fused_experts=True)
    fp8 = export_fp8(src, tmp_path / "fp8", block_size=BLOCK)
    cfg = dataclasses.replace(ModelConfig.from_pretrained(fp8), backend="gpu", gpu_kernels="triton")
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          convert_checkpoint(fp8, cfg, "bfloat16", fp8_weights="keep"))
    buffers = jax.eval_shape(lambda: allocate_cache_buffers(cache_layout(cfg, jnp.bfloat16), num_blocks=8,
                                                            block_size=16, num_state_rows=4))
    table = BucketTable(max_num_seqs=2, max_num_batched_tokens=64, max_blocks=4, prefill_chunk=32,
                        max_prefill_groups_extra=1)
    bucket = next(b for b in table.mixed if b.chunk == 32)
    segments = [Segment([0], 0, [0], -1, 0), Segment([0] * 2, 0, [0], -1, 0)]
    inputs = build_step_inputs(segments, bucket.sizes, block_size=16, chunk=bucket.chunk)
    text = make_engine_step(cfg).trace(params, buffers, inputs).lower(lowering_platforms=("cuda",)).as_text()
    main = text[text.index("func.func public @main"):].split("\n", 1)[0]
    fp8_args = main.count("f8E4M3FN>")
    assert fp8_args == sum(x.dtype == jnp.float8_e4m3fn for x in jax.tree.leaves(params)) >= 5, fp8_args


def test_update_weights_into_kept_fp8_weights_says_what_to_do(tmp_path):
    from qnext.model.loader import load_params
    from qnext.model.placement import WeightUpdate

    src = write_tiny_checkpoint(tmp_path / "bf16", "qwen3_5", seed=5, dtype="bfloat16")
    fp8 = export_fp8(src, tmp_path / "fp8", block_size=BLOCK)
    cfg = ModelConfig.from_pretrained(fp8)
    placed = load_params(fp8, cfg, "bfloat16", fp8_weights="keep")
    with pytest.raises(ValueError, match="fp8_weights='dequantize'"):
        WeightUpdate(cfg, "bfloat16")(placed, convert_checkpoint(src, cfg, "bfloat16"))
