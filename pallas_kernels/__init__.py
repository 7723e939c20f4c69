"""Ops used by the qnext model: Pallas kernels for NVIDIA GPUs, in two backends (Triton: *_pallas.py; Mosaic GPU
for Hopper: *_mosaic.py), plus a pure-jnp reference each.

Every public op dispatches: `implementation=None` picks the Pallas backend chosen for the device on GPU
(backend_choice.py) and the reference elsewhere; "pallas", "triton", "mosaic" or "reference" force one;
`interpret=True` runs a kernel in interpret mode (CPU tests). Details: api.py.
Layouts and row semantics: docs/CONTRACTS.md and the module docstrings.
"""
from pallas_kernels.api import (
    causal_conv1d_chunked,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    paged_attention,
    recurrent_gated_delta_rule,
    write_kv,
)

__all__ = [
    "causal_conv1d_chunked",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "paged_attention",
    "recurrent_gated_delta_rule",
    "write_kv",
]
