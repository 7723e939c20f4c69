"""Public, validated entry points of the ops; each dispatches between its Pallas kernels and its reference.

implementation: None (GPU: the Pallas backend chosen for this device by backend_choice; elsewhere the reference),
"pallas" (the chosen Pallas backend), "triton", "mosaic" or "reference". Under "mosaic" an op without a Mosaic GPU
kernel (the chunked conv1d) or with shapes its kernel does not take (e.g. float32 KV pages, dims not multiples of
64) runs the reference (XLA), with one warning per op and reason. interpret=True runs the Triton kernel in Pallas's
generic interpreter, or with implementation="mosaic" the Mosaic GPU kernel in the Mosaic GPU interpreter, where
unsupported shapes raise instead of falling back (a test must see them).
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from pallas_kernels import causal_conv1d as conv_ops
from pallas_kernels import gated_delta_rule as gdr_ops
from pallas_kernels import paged_attention as attn_ops


logger = logging.getLogger(__name__)
IMPLEMENTATIONS = (None, "reference", "pallas", "triton", "mosaic")


@functools.lru_cache(maxsize=None)
def _device_backend():
    from pallas_kernels import backend_choice
    return backend_choice.resolve_gpu_kernel_backend("auto")


def _implementation(implementation, interpret):
    """"reference", "triton" or "mosaic" for this call."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if interpret:
        return implementation if implementation in ("reference", "mosaic") else "triton"
    if implementation is None:
        implementation = "pallas" if jax.default_backend() == "gpu" else "reference"
    return _device_backend() if implementation == "pallas" else implementation


@functools.lru_cache(maxsize=None)
def _warn_fallback(op, reason):
    logger.warning("%s: no Mosaic GPU kernel for this call (%s); running the jnp reference", op, reason)


def _mosaic_or_reference(op, interpret, mosaic_call, reference_call):
    """The Mosaic GPU kernel, or the reference where the kernel rejects the shapes (raises under interpret)."""
    try:
        return mosaic_call()
    except ValueError as err:
        if interpret or "Mosaic GPU kernel" not in str(err):
            raise
        _warn_fallback(op, str(err))
        return reference_call()


def _check(cond, message):
    if not cond:
        raise ValueError(message)


def _check_rows(name, rows, n):
    _check(rows.shape == (n,), f"{name} must have shape [{n}], got {rows.shape}")
    _check(jnp.issubdtype(rows.dtype, jnp.integer), f"{name} must be an integer array, got {rows.dtype}")


def _check_heads(q_heads, kv_heads, what):
    _check(kv_heads > 0 and q_heads % kv_heads == 0,
           f"{what}: {q_heads} query heads are not a multiple of {kv_heads} key/value heads")


def write_kv(k_pages, v_pages, k, v, slot_mapping, *, implementation=None):
    """Write new keys/values [T, Hkv, D] into the pages at flat slots [T]. Returns (k_pages, v_pages).
    Both forms are XLA scatters, in place on donated pages; with a GPU implementation the scatter indexes the pages'
    leading dims (paged_attention.write_kv_leading: XLA:GPU would copy the pages for the reference's form)."""
    _check(k_pages.ndim == 4 and k_pages.shape == v_pages.shape,
           f"k_pages and v_pages must both be [Hkv, blocks, block_size, D], got {k_pages.shape} and {v_pages.shape}")
    hkv, d = k_pages.shape[0], k_pages.shape[3]
    _check(k.ndim == 3 and k.shape == v.shape and k.shape[1:] == (hkv, d),
           f"k/v must be [T, {hkv}, {d}], got {k.shape} and {v.shape}")
    _check(slot_mapping.shape == k.shape[:1], f"slot_mapping must be [{k.shape[0]}], got {slot_mapping.shape}")
    if _implementation(implementation, False) == "reference":
        return attn_ops.write_kv_reference(k_pages, v_pages, k, v, slot_mapping)
    return attn_ops.write_kv_leading(k_pages, v_pages, k, v, slot_mapping)


def paged_attention(q, k_pages, v_pages, block_table, kv_len, q_pos, *, sm_scale, implementation=None,
                    interpret=False):
    """Attention of query groups [N, L, Hq, D] over paged KV; see paged_attention.py. Returns [N, L, Hq, D] f32."""
    _check(q.ndim == 4, f"q must be [N, L, Hq, D], got {q.shape}")
    n, length, hq, d = q.shape
    _check(k_pages.ndim == 4 and k_pages.shape == v_pages.shape and k_pages.shape[3] == d,
           f"pages must be [Hkv, blocks, block_size, {d}], got {k_pages.shape} and {v_pages.shape}")
    _check_heads(hq, k_pages.shape[0], "paged_attention")
    _check(block_table.ndim == 2 and block_table.shape[0] == n, f"block_table must be [{n}, MB], got {block_table.shape}")
    _check(kv_len.shape == (n,), f"kv_len must be [{n}], got {kv_len.shape}")
    _check(q_pos.shape == (n, length), f"q_pos must be [{n}, {length}], got {q_pos.shape}")
    impl = _implementation(implementation, interpret)
    if impl == "mosaic" and k_pages.dtype == jnp.float8_e4m3fn:
        impl = "triton"          # fp8 pages: the Triton kernel widens them in registers; the Mosaic one takes bf16
    args = (q, k_pages, v_pages, block_table, kv_len, q_pos)
    reference = functools.partial(attn_ops.paged_attention_reference, *args, sm_scale=sm_scale,
                                  leading_gather=impl != "reference")
    if impl == "triton":
        from pallas_kernels import paged_attention_pallas
        return paged_attention_pallas.paged_attention(*args, sm_scale=sm_scale, interpret=interpret)
    if impl == "mosaic":
        from pallas_kernels import paged_attention_mosaic
        return _mosaic_or_reference("paged_attention", interpret, functools.partial(
            paged_attention_mosaic.paged_attention, *args, sm_scale=sm_scale, interpret=interpret), reference)
    return reference()


def _check_gdr(q, k, v, g, beta, state, lead):
    hk, dk = q.shape[-2:]
    hv, dv = v.shape[-2:]
    _check(k.shape == q.shape, f"k must match q's shape {q.shape}, got {k.shape}")
    _check(v.shape[:-2] == lead and q.shape[:-2] == lead, f"q/k/v leading dims must be {lead}")
    _check_heads(hv, hk, "gated delta rule (value heads vs key heads)")
    _check(g.shape == lead + (hv,) and beta.shape == lead + (hv,), f"g and beta must be {lead + (hv,)}")
    _check(state.ndim == 4 and state.shape[1:] == (hv, dk, dv),
           f"state must be [rows, {hv}, {dk}, {dv}], got {state.shape}")
    _check(state.dtype == jnp.float32, f"state must be float32, got {state.dtype}")


def chunk_gated_delta_rule(q, k, v, g, beta, length, state, read_row, write_row, capture_row, is_first, is_last, *,
                           implementation=None, interpret=False):
    """Chunked gated delta rule over groups [N, C, ...]; see gated_delta_rule.py. Returns (o f32, state)."""
    _check(q.ndim == 4, f"q must be [N, C, Hk, dk], got {q.shape}")
    n = q.shape[0]
    _check_gdr(q, k, v, g, beta, state, q.shape[:2])
    for name, rows in (("length", length), ("read_row", read_row), ("write_row", write_row),
                       ("capture_row", capture_row)):
        _check_rows(name, rows, n)
    _check(is_first.shape == (n,) and is_last.shape == (n,), f"is_first/is_last must be [{n}]")
    impl = _implementation(implementation, interpret)
    args = (q, k, v, g, beta, length, state, read_row, write_row, capture_row, is_first, is_last)
    reference = functools.partial(gdr_ops.chunk_gated_delta_rule_reference, *args)
    if impl == "triton":
        from pallas_kernels import gated_delta_rule_pallas
        return gated_delta_rule_pallas.chunk_gated_delta_rule(*args, interpret=interpret)
    if impl == "mosaic":
        from pallas_kernels import gated_delta_rule_mosaic
        return _mosaic_or_reference("chunk_gated_delta_rule", interpret, functools.partial(
            gated_delta_rule_mosaic.chunk_gated_delta_rule, *args, interpret=interpret), reference)
    return reference()


def recurrent_gated_delta_rule(q, k, v, g, beta, state, read_row, write_row, capture_row, *, implementation=None,
                               interpret=False):
    """One token per row [N, ...] (decode); see gated_delta_rule.py. Returns (o [N, Hv, dv] f32, state)."""
    _check(q.ndim == 3, f"q must be [N, Hk, dk], got {q.shape}")
    n = q.shape[0]
    _check_gdr(q, k, v, g, beta, state, q.shape[:1])
    for name, rows in (("read_row", read_row), ("write_row", write_row), ("capture_row", capture_row)):
        _check_rows(name, rows, n)
    impl = _implementation(implementation, interpret)
    args = (q, k, v, g, beta, state, read_row, write_row, capture_row)
    reference = functools.partial(gdr_ops.recurrent_gated_delta_rule_reference, *args)
    if impl == "triton":
        from pallas_kernels import gated_delta_rule_pallas
        return gated_delta_rule_pallas.recurrent_gated_delta_rule(*args, interpret=interpret)
    if impl == "mosaic":
        from pallas_kernels import gated_delta_rule_mosaic
        return _mosaic_or_reference("recurrent_gated_delta_rule", interpret, functools.partial(
            gated_delta_rule_mosaic.recurrent_gated_delta_rule, *args, interpret=interpret), reference)
    return reference()


def _check_conv(x_channels, weight, conv_state):
    _check(weight.ndim == 2 and weight.shape[0] == x_channels,
           f"conv weight must be [{x_channels}, K], got {weight.shape}")
    _check(conv_state.ndim == 3 and conv_state.shape[1:] == (weight.shape[1] - 1, x_channels),
           f"conv_state must be [rows, {weight.shape[1] - 1}, {x_channels}], got {conv_state.shape}")


def causal_conv1d_chunked(x, weight, conv_state, length, read_row, write_row, capture_row, is_first, is_last, *,
                          implementation=None, interpret=False):
    """Causal conv1d + SiLU over groups x [N, C, D]; see causal_conv1d.py. Returns (y, conv_state)."""
    _check(x.ndim == 3, f"x must be [N, C, D], got {x.shape}")
    n = x.shape[0]
    _check_conv(x.shape[2], weight, conv_state)
    for name, rows in (("length", length), ("read_row", read_row), ("write_row", write_row),
                       ("capture_row", capture_row)):
        _check_rows(name, rows, n)
    impl = _implementation(implementation, interpret)
    args = (x, weight, conv_state, length, read_row, write_row, capture_row, is_first, is_last)
    if impl == "triton":
        from pallas_kernels import causal_conv1d_pallas
        return causal_conv1d_pallas.causal_conv1d_chunked(*args, interpret=interpret)
    # "mosaic": no Mosaic GPU kernel for the chunked conv (a small share of a prefill step): the reference (XLA).
    return conv_ops.causal_conv1d_chunked_reference(*args)


def causal_conv1d_update(x, weight, conv_state, read_row, write_row, capture_row, *, implementation=None,
                         interpret=False):
    """Single-step causal conv1d + SiLU, x [N, D]; see causal_conv1d.py. Returns (y, conv_state)."""
    _check(x.ndim == 2, f"x must be [N, D], got {x.shape}")
    n = x.shape[0]
    _check_conv(x.shape[1], weight, conv_state)
    for name, rows in (("read_row", read_row), ("write_row", write_row), ("capture_row", capture_row)):
        _check_rows(name, rows, n)
    impl = _implementation(implementation, interpret)
    args = (x, weight, conv_state, read_row, write_row, capture_row)
    reference = functools.partial(conv_ops.causal_conv1d_update_reference, *args)
    if impl == "triton":
        from pallas_kernels import causal_conv1d_pallas
        return causal_conv1d_pallas.causal_conv1d_update(*args, interpret=interpret)
    if impl == "mosaic":
        from pallas_kernels import causal_conv1d_mosaic
        return _mosaic_or_reference("causal_conv1d_update", interpret, functools.partial(
            causal_conv1d_mosaic.causal_conv1d_update, *args, interpret=interpret), reference)
    return reference()
