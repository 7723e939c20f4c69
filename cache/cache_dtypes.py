"""The cache's narrower storage dtypes, by vLLM's option names (plain Python, no jax).

`kv_cache_dtype`: "auto" keeps the attention KV in the model dtype; "fp8" (= "fp8_e4m3") stores it as e4m3 with a
scale (stored = value / scale, read back as stored * scale; vLLM's default 1.0 for hybrids), one byte a value.
`mamba_ssm_cache_dtype`: the recurrent state of stored snapshots in the host tier and in the persisted cache
("auto" = float32). The live recurrent state always accumulates in float32 on the device (narrowing it each step
collapses accuracy); a narrow snapshot is widened back to float32 when it is restored.
"""
from __future__ import annotations

KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "bfloat16": "bfloat16",
                   "float32": "float32"}
MAMBA_SSM_CACHE_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV pages' dtype name for the option value; ValueError naming the choices."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def snapshot_storage_dtype(mamba_ssm_cache_dtype: str) -> str:
    """The stored snapshots' recurrent-state dtype name for the option value; ValueError naming the choices."""
    if mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
        raise ValueError(f"mamba_ssm_cache_dtype must be one of {sorted(MAMBA_SSM_CACHE_DTYPES)}, "
                         f"got {mamba_ssm_cache_dtype!r}")
    return MAMBA_SSM_CACHE_DTYPES[mamba_ssm_cache_dtype]
