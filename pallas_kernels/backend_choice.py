"""Which Pallas GPU backend the kernels use: Mosaic GPU or Triton, chosen once at engine start.

Rule (`choose_gpu_kernel_backend`, a pure function of the JAX version and the device's compute capability):
- "mosaic" (Pallas Mosaic GPU, *_mosaic.py) on Hopper (compute capability 9.x, sm_90a) with JAX >= 0.10.2: the
  kernels use wgmma, Hopper's tensor-core instruction (Blackwell, 10.x and up, has tcgen05 instead), and were
  written against the plgpu API of 0.10.2 (also in 0.11).
- "triton" (Pallas Triton, *_pallas.py) everywhere else: GPUs before Hopper, Blackwell and newer, and JAX older
  than 0.10.2. JAX 0.11.0 deprecated Pallas's Triton backend (it still runs, with a DeprecationWarning); a
  GPU that is not Hopper has no Mosaic GPU kernel here, so it stays on Triton, with a warning from 0.11 on.
- A GPU without a CUDA compute capability (not NVIDIA, e.g. ROCm) gets Triton.
- An explicit "mosaic" or "triton" overrides the rule; "mosaic" where it cannot run is an error.
"""
from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "mosaic", "triton")
MOSAIC_MIN_JAX = (0, 10, 2)          # the plgpu API these kernels use (mesh kernels, layouts, wgmma, interpreter)
TRITON_DEPRECATED_JAX = (0, 11, 0)   # Pallas Triton lowering deprecated


def parse_version(version) -> tuple[int, int, int]:
    """'0.10.2', '0.11.1.dev20260808', (0, 11) -> (major, minor, patch)."""
    if isinstance(version, tuple):
        return tuple(int(x) for x in (version + (0, 0, 0))[:3])
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not match:
        raise ValueError(f"cannot parse a JAX version from {version!r}")
    return tuple(int(x or 0) for x in match.groups())


def parse_capability(capability) -> tuple[int, int]:
    """'9.0', '90', (9, 0), 9.0 -> (9, 0)."""
    if isinstance(capability, tuple):
        return int(capability[0]), int(capability[1]) if len(capability) > 1 else 0
    text = str(capability)
    match = re.fullmatch(r"(\d+)\.(\d+)", text) or re.fullmatch(r"(\d+)(\d)", text)
    if not match:
        raise ValueError(f"cannot parse a compute capability from {capability!r}")
    return int(match.group(1)), int(match.group(2))


def choose_gpu_kernel_backend(jax_version, compute_capability, requested: str = "auto") -> tuple[str, str]:
    """(backend, reason): "mosaic" or "triton" for a GPU of `compute_capability` under `jax_version`."""
    if requested not in BACKENDS:
        raise ValueError(f"gpu_kernel_backend must be one of {BACKENDS}, got {requested!r}")
    version, (major, minor) = parse_version(jax_version), parse_capability(compute_capability)
    jax_text, cc_text = ".".join(map(str, version)), f"sm_{major}{minor}"
    hopper = major == 9
    new_enough = version >= MOSAIC_MIN_JAX
    if requested == "mosaic":
        if not hopper:
            raise ValueError(f"gpu_kernel_backend='mosaic' needs a Hopper GPU (compute capability 9.x: the kernels "
                             f"use wgmma), this device is {cc_text}; use 'triton' or 'auto'")
        if not new_enough:
            raise ValueError(f"gpu_kernel_backend='mosaic' needs JAX >= {'.'.join(map(str, MOSAIC_MIN_JAX))}, "
                             f"this is JAX {jax_text}; use 'triton' or 'auto'")
        return "mosaic", f"requested; {cc_text}, JAX {jax_text}"
    deprecated = " (Pallas Triton is deprecated from JAX 0.11)" if version >= TRITON_DEPRECATED_JAX else ""
    if requested == "triton":
        return "triton", f"requested; {cc_text}, JAX {jax_text}{deprecated}"
    if hopper and new_enough:
        return "mosaic", f"Hopper {cc_text} with JAX {jax_text} >= {'.'.join(map(str, MOSAIC_MIN_JAX))}"
    if not hopper:
        why = f"{cc_text} is not Hopper (the Mosaic GPU kernels use wgmma, sm_90a only)"
    else:
        why = f"JAX {jax_text} is older than {'.'.join(map(str, MOSAIC_MIN_JAX))}"
    return "triton", why + deprecated


def device_compute_capability(device=None) -> str | None:
    """The compute capability of `device` (default: JAX's first device) as 'major.minor'; None off CUDA."""
    import jax

    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return None if capability is None else str(capability)


def resolve_gpu_kernel_backend(requested: str = "auto", device=None) -> str:
    """The backend for this process's GPU, logged once per call (engine start)."""
    import jax

    capability = device_compute_capability(device)
    if capability is None:                 # not an NVIDIA GPU (e.g. ROCm): Pallas Triton is the only GPU backend
        if requested == "mosaic":
            raise ValueError("gpu_kernel_backend='mosaic' needs an NVIDIA Hopper GPU; this device reports no CUDA "
                             "compute capability")
        backend, reason = "triton", "the device reports no CUDA compute capability (not an NVIDIA GPU)"
    else:
        backend, reason = choose_gpu_kernel_backend(jax.__version__, capability, requested)
    log = logger.warning if backend == "triton" and "deprecated" in reason else logger.info
    log("GPU kernels: Pallas %s backend (%s)", "Mosaic GPU" if backend == "mosaic" else "Triton", reason)
    return backend
