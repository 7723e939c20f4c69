"""The engine step, lowered for CUDA on a CPU-only host with each Pallas GPU backend, updates every cache buffer in
place: nothing in it copies a whole KV page array or state pool (the cache sizing assumes the step allocates no
more with a bigger cache; a copy of the pages of one layer was a 47 GiB allocation on an H200).

Checked on the StableHLO (lowering only, no CUDA compile):
- every cache buffer is donated and aliased to its output (tf.aliasing_output on the step's arguments);
- every custom call (Pallas kernel) that returns an array of a cache buffer's type aliases it to an operand;
- every scatter or gather on a cache buffer indexes its leading dims: XLA:GPU rewrites one indexed on other dims
  with its operand transposed first (ScatterSimplifier / GatherSimplifier), i.e. a copy of the whole buffer.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from cache.device_buffers import allocate_cache_buffers
from qnext.bench.presets import PRESETS
from qnext.config import ModelConfig
from qnext.engine.multi_step import make_multi_step
from qnext.engine.runner import make_engine_step
from qnext.engine.window import WindowInputs
from qnext.model.buckets import BucketTable
from qnext.model.cache_layout import cache_layout
from qnext.model.step_inputs import Segment, build_step_inputs
from qnext.model.weights import map_specs, param_specs
from qnext.testing.tiny_checkpoint import tiny_hf_config

BLOCK_SIZE, NUM_BLOCKS, NUM_ROWS = 16, 50, 7      # sizes no other array of the step has
NUM_POOL_ROWS, NUM_STAGING_ROWS = 11, 2           # a narrow (bf16) snapshot pool's rows, and the float32 staging rows


def _buffers(cfg, dtype, narrow: bool, extra_kv_layers: int = 0):
    """The cache buffers' shapes: one float32 state buffer, or (narrow) live rows + a bf16 snapshot pool."""
    if not narrow:
        return jax.eval_shape(lambda: allocate_cache_buffers(cache_layout(cfg, dtype, extra_kv_layers),
                                                             num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                                             num_state_rows=NUM_ROWS))
    layout = cache_layout(cfg, dtype, extra_kv_layers, mamba_ssm_cache_dtype="bfloat16")
    return jax.eval_shape(lambda: allocate_cache_buffers(layout, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                                         num_state_rows=NUM_ROWS, num_pool_rows=NUM_POOL_ROWS,
                                                         num_staging_rows=NUM_STAGING_ROWS))


def _mlir_type(x) -> str:
    return f"tensor<{'x'.join(map(str, x.shape))}x{jnp.dtype(x.dtype).name.replace('float', 'f')}>"


def _lowered_step(kernels: str, multi_step: bool = False, dtype=jnp.bfloat16, narrow: bool = False):
    """(StableHLO text, cache buffer types, index of the first cache argument, their count) of the small bench
    model's step for a mixed bucket (decode rows and 64-token prefill groups), bf16, on CUDA with `kernels`; or of
    its multi-step decode call (8 steps of 2 rows). float32 pages: the Mosaic backend's attention runs the reference.
    narrow: with a bf16 snapshot pool (the step's restores and captures staged through float32 rows)."""
    preset = PRESETS["small"]                      # real head dims: the Mosaic kernels take these shapes
    cfg = dataclasses.replace(ModelConfig.from_hf_config(tiny_hf_config(preset.family, **preset.overrides)),
                              backend="gpu", gpu_kernels=kernels)
    params = map_specs(lambda _, s: jax.ShapeDtypeStruct(s.shape, s.dtype), param_specs(cfg, jnp.dtype(dtype).name))
    buffers = _buffers(cfg, dtype, narrow)
    table = BucketTable(max_num_seqs=4, max_num_batched_tokens=128, max_blocks=8, prefill_chunk=64,
                        max_prefill_groups_extra=2)
    if multi_step:
        bucket = table.decode[1]
        segments = [Segment([0], 0, [0], -1, 0)] * 2
        inputs = build_step_inputs(segments, bucket.sizes, block_size=BLOCK_SIZE, chunk=bucket.chunk)
        traced = make_multi_step(cfg, 8, BLOCK_SIZE).trace(params, buffers, inputs, WindowInputs.padding(2, 8), None)
    else:
        bucket = next(b for b in table.mixed if b.chunk == 64)
        segments = [Segment([0], 0, [0], -1, 0), Segment([0] * 2, 0, [0], -1, 0)]
        inputs = build_step_inputs(segments, bucket.sizes, block_size=BLOCK_SIZE, chunk=bucket.chunk)
        traced = make_engine_step(cfg).trace(params, buffers, inputs)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    types = {_mlir_type(x) for x in jax.tree.leaves(buffers)}
    return text, types, len(jax.tree.leaves(params)), len(jax.tree.leaves(buffers))


def _leading(dims: str) -> bool:
    values = [int(d) for d in dims.split(",") if d.strip()]
    return values == list(range(len(values)))


def _step_violations(text: str, cache_types: set[str], first: int, count: int) -> list[str]:
    bad = []
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    for i in range(first, first + count):
        arg = re.search(rf"%arg{i}: (tensor<[^>]*>)( \{{[^}}]*\}})?", main)
        if arg.group(1) not in cache_types or "tf.aliasing_output" not in (arg.group(2) or ""):
            bad.append(f"step argument {i} ({arg.group(1)}) is not a cache buffer aliased to an output")
    lines = text.split("\n")
    for n, line in enumerate(lines):
        if "stablehlo.custom_call" in line:
            result_types = re.findall(r"tensor<[^>]*>", line[line.rindex(") -> "):])   # the kernel's blob is before
            aliased = {int(i or 0) for i in re.findall(r"output_tuple_indices = \[(\d*)\]", line)}
            target = re.search(r"custom_call @(\S+?)\(", line).group(1)
            bad += [f"custom call {target} returns a {t} (a cache buffer's type) not aliased to an operand"
                    for j, t in enumerate(result_types) if t in cache_types and j not in aliased]
        for op, key, sig in (("scatter", "scatter_dims_to_operand_dims", None), ("gather", "start_index_map", n)):
            if f'"stablehlo.{op}"' not in line:
                continue
            dims = re.search(rf"{key} = \[([0-9, ]*)\]", line).group(1)
            if sig is None:                          # a scatter's types follow its update region
                sig = next(m for m in range(n, len(lines)) if lines[m].lstrip().startswith("}) :"))
            operand = re.search(r"[)>] : \((tensor<[^>]*>)", lines[sig]).group(1)
            if operand in cache_types and not _leading(dims):
                bad.append(f"{op} on a cache buffer {operand} indexes dims [{dims}], not its leading dims: "
                           "XLA:GPU transposes (copies) the whole buffer first")
    return bad


@pytest.mark.parametrize("narrow", [False, True], ids=["one_state_buffer", "bf16_snapshot_pool"])
@pytest.mark.parametrize("multi_step", [False, True], ids=["step", "multi_step"])
@pytest.mark.parametrize("kernels", ["mosaic", "triton"])
def test_engine_step_updates_every_cache_buffer_in_place_on_cuda(kernels, multi_step, narrow):
    text, cache_types, first, count = _lowered_step(kernels, multi_step, narrow=narrow)
    assert ("mosaic_gpu" in text) == (kernels == "mosaic") and ("xla.gpu.triton" in text) == (kernels == "triton")
    assert _step_violations(text, cache_types, first, count) == []


def test_float32_step_with_mosaic_attention_falling_back_updates_the_pages_in_place_on_cuda():
    """float32 pages: the Mosaic backend's attention runs the reference, whose page gather must index the pages'
    leading dims too (a loop over spans: a transposed copy of the pages per span)."""
    text, cache_types, first, count = _lowered_step("mosaic", dtype=jnp.float32)
    assert _step_violations(text, cache_types, first, count) == []


def test_the_check_sees_a_scatter_that_xla_gpu_would_copy():
    """The scatter form XLA:GPU copies (the pages indexed on block and row for every head) is reported."""
    import importlib
    attn_ops = importlib.import_module("pallas_kernels.paged_attention")   # the package exports a function so named

    pages = jax.ShapeDtypeStruct((2, NUM_BLOCKS, BLOCK_SIZE, 64), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((3, 2, 64), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((3,), jnp.int32)
    for write, copies in ((attn_ops.write_kv_reference, True), (attn_ops.write_kv_leading, False)):
        text = jax.jit(write, donate_argnums=(0, 1)).trace(pages, pages, new, new, slots).lower(
            lowering_platforms=("cuda",)).as_text()
        bad = _step_violations(text, {_mlir_type(pages)}, 0, 2)
        assert bool(bad) == copies and all("scatter" in b for b in bad), bad


def test_cache_copies_index_the_pages_leading_dims_on_cuda():
    """The other jitted functions on the cache buffers (fork copies, host-tier saves and restores) also index
    the pages on their leading dims, and the donated ones update them in place."""
    from cache import buffer_copies, device_buffers, fork_buffer_copies

    layout = device_buffers.CacheLayout(num_kv_layers=1, num_kv_heads=2, head_dim=64, num_state_layers=1,
                                        conv_width=4, conv_dim=96, num_v_heads=2, k_head_dim=64, v_head_dim=64,
                                        dtype="bfloat16")
    buffers = jax.eval_shape(lambda: allocate_cache_buffers(layout, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                                            num_state_rows=NUM_ROWS))
    types = {_mlir_type(x) for x in jax.tree.leaves(buffers)}
    idx = jax.ShapeDtypeStruct((4,), jnp.int32)
    block_values = [(jax.ShapeDtypeStruct((2, 4, BLOCK_SIZE, 64), jnp.bfloat16),) * 2]
    cases = [(fork_buffer_copies._fork_copy, (buffers, idx, idx, idx, idx), len(jax.tree.leaves(buffers))),
             (buffer_copies.scatter_blocks, (buffers.kv, idx, block_values), 2),
             (buffer_copies.gather_blocks, (buffers.kv, idx), 0)]
    for fn, args, donated in cases:
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert _step_violations(text, types, 0, donated) == [], fn.__name__


@pytest.mark.parametrize("narrow", [False, True], ids=["one_state_buffer", "bf16_snapshot_pool"])
@pytest.mark.parametrize("call", ["speculative_step", "mtp_catch_up"])
@pytest.mark.parametrize("kernels", ["mosaic", "triton"])
def test_mtp_calls_update_every_cache_buffer_in_place_on_cuda(kernels, call, narrow):
    """MTP speculative decoding's two calls (qnext/engine/spec_step.py) lower for CUDA and keep every cache buffer,
    the head's own KV layer included, in place: the verify pass writes no state pool until the kept position's
    state goes to its row."""
    import numpy as np

    from qnext.engine.spec_step import ChainInputs, make_mtp_catch_up, make_spec_step, verify_inputs, window_length
    from qnext.model.mtp import init_mtp_params

    preset, dtype, k = PRESETS["small"], jnp.bfloat16, 2
    cfg = dataclasses.replace(ModelConfig.from_hf_config(tiny_hf_config(preset.family, **preset.overrides)),
                              backend="gpu", gpu_kernels=kernels)
    params = map_specs(lambda _, s: jax.ShapeDtypeStruct(s.shape, s.dtype), param_specs(cfg, jnp.dtype(dtype).name))
    mtp = jax.eval_shape(lambda p: init_mtp_params(p, cfg, jax.random.key(0)), params)
    buffers = _buffers(cfg, dtype, narrow, extra_kv_layers=1)
    if call == "speculative_step":
        d, length = 2, window_length(k, "gpu")
        inputs = verify_inputs([], [], [], [], [], d, length, 8, BLOCK_SIZE)
        traced = make_spec_step(cfg, k, BLOCK_SIZE).trace(params, mtp, buffers, inputs, WindowInputs.padding(d, k + 1),
                                                          None)
    else:
        table = BucketTable(max_num_seqs=4, max_num_batched_tokens=128, max_blocks=8, prefill_chunk=64,
                            max_prefill_groups_extra=2)
        bucket = next(b for b in table.mixed if b.chunk == 64)
        segments = [Segment([0], 0, [0], -1, 0), Segment([0] * 2, 0, [0], -1, 0)]
        inputs = build_step_inputs(segments, bucket.sizes, block_size=BLOCK_SIZE, chunk=bucket.chunk)
        s = bucket.sizes
        hidden = jax.ShapeDtypeStruct((s.num_tokens, cfg.hidden_size), dtype)
        chain = ChainInputs(block_table=np.zeros((s.num_logits, s.max_blocks), np.int32),
                            running=np.zeros(s.num_logits, bool))
        traced = make_mtp_catch_up(cfg, k, BLOCK_SIZE).trace(params, mtp, buffers, inputs,
                                                             np.zeros(s.num_tokens, np.int32), hidden, chain)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    types = {_mlir_type(x) for x in jax.tree.leaves(buffers)}
    # weights the call does not read are pruned from its arguments: find the cache buffers by their types
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    cache_args = [m for m in re.finditer(r"%arg\d+: (tensor<[^>]*>)( \{[^}]*\})?", main) if m.group(1) in types]
    assert len(cache_args) == len(jax.tree.leaves(buffers))
    assert all("tf.aliasing_output" in (m.group(2) or "") for m in cache_args)
    assert _step_violations(text, types, 0, 0) == []
