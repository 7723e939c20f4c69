"""The Pallas GPU backend choice: a pure function of (JAX version, compute capability, requested), and its log."""
from __future__ import annotations

import dataclasses
import logging
import types

import pytest

from pallas_kernels import backend_choice as bc
from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig


@pytest.mark.parametrize("jax_version, capability, want", [
    ("0.10.2", "9.0", "mosaic"),                 # H100 / H200 on the newest JAX for Python 3.11
    ("0.11.2", "9.0", "mosaic"),                 # a current GPU image
    ("0.11.1.dev20260808", "90", "mosaic"),      # dev versions, capability without the dot
    ("0.10.1", "9.0", "triton"),                 # JAX before the plgpu API these kernels use
    ("0.9.2", (9, 0), "triton"),
    ("0.10.2", "8.0", "triton"),                 # A100: no wgmma
    ("0.10.2", "8.9", "triton"),                 # L4 / L40
    ("0.11.2", "8.6", "triton"),                 # Ampere on a JAX that deprecates Triton: still the only kernels
    ("0.11.2", "10.0", "triton"),                # Blackwell: tcgen05, not wgmma
    ("0.11.2", "12.0", "triton"),
])
def test_auto_choice(jax_version, capability, want):
    backend, reason = bc.choose_gpu_kernel_backend(jax_version, capability)
    assert backend == want
    assert reason
    major = bc.parse_version(jax_version)[:2]
    assert ("deprecated" in reason) == (want == "triton" and major >= (0, 11))


def test_explicit_choice_overrides_and_impossible_requests_fail():
    assert bc.choose_gpu_kernel_backend("0.10.2", "9.0", "triton")[0] == "triton"
    assert bc.choose_gpu_kernel_backend("0.11.0", "9.0", "mosaic")[0] == "mosaic"
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        bc.choose_gpu_kernel_backend("0.11.0", "8.0", "mosaic")
    with pytest.raises(ValueError, match="needs JAX >= 0.10.2"):
        bc.choose_gpu_kernel_backend("0.10.0", "9.0", "mosaic")
    with pytest.raises(ValueError, match="gpu_kernel_backend must be one of"):
        bc.choose_gpu_kernel_backend("0.10.2", "9.0", "cuda")
    with pytest.raises(ValueError, match="cannot parse a compute capability"):
        bc.choose_gpu_kernel_backend("0.10.2", "hopper")


def test_resolve_logs_the_choice_for_a_device(caplog):
    hopper = types.SimpleNamespace(compute_capability="9.0")
    with caplog.at_level(logging.INFO, logger=bc.__name__):
        backend = bc.resolve_gpu_kernel_backend("auto", device=hopper)
    import jax
    want = "mosaic" if bc.parse_version(jax.__version__) >= bc.MOSAIC_MIN_JAX else "triton"
    assert backend == want
    assert "GPU kernels: Pallas" in caplog.text
    assert bc.resolve_gpu_kernel_backend("auto", device=types.SimpleNamespace()) == "triton"     # e.g. ROCm
    with pytest.raises(ValueError, match="needs an NVIDIA Hopper GPU"):
        bc.resolve_gpu_kernel_backend("mosaic", device=types.SimpleNamespace())


def test_engine_option_and_model_config_carry_the_backend():
    assert EngineConfig().gpu_kernel_backend == "auto"
    with pytest.raises(ValueError, match="gpu_kernel_backend must be"):
        EngineConfig(gpu_kernel_backend="cuda")
    from qnext.testing.tiny_checkpoint import tiny_hf_config
    cfg = ModelConfig.from_hf_config(tiny_hf_config("qwen3_next"))
    assert cfg.gpu_kernels is None
    assert cfg.with_backend("cpu").kernels == "reference"
    assert cfg.with_backend("gpu").kernels == "pallas"                       # the ops choose on first use
    assert dataclasses.replace(cfg, gpu_kernels="mosaic").with_backend("gpu").kernels == "mosaic"
    assert dataclasses.replace(cfg, gpu_kernels="triton").with_backend("gpu").kernels == "triton"
