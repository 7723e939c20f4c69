"""Ops used by the qnext model: each is a Pallas kernel for NVIDIA GPUs plus a pure-jnp reference.

Every public op dispatches: `implementation=None` picks the Pallas kernel on GPU and the reference elsewhere;
"reference" or "pallas" force one; `interpret=True` runs the Pallas kernel in interpret mode (CPU tests).
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
