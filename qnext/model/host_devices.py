"""CPU host devices for tensor parallelism. XLA reads the flag when JAX's CPU backend starts (the first device query
or computation, not the import), so request them before that."""
from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"


def request_host_devices(count: int) -> None:
    """Asks XLA:CPU for `count` host devices (XLA_FLAGS), unless the flags already set a count. On a GPU the flag
    only concerns the CPU platform; the GPUs are the devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 1 and _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()


def engine_devices(count: int = 1) -> list:
    """The `count` devices an engine places its params and cache on: from `jax.default_device` (a data parallel
    replica's first device) onward when one is set, else from the first device."""
    import jax

    devices = jax.devices()
    default = jax.config.jax_default_device
    start = devices.index(default) if default is not None and default in devices else 0
    return devices[start:start + count]


def device_mesh(n: int, option: str, axis: str):
    """A 1-D mesh over the engine's first `n` devices (engine_devices) for the engine option `option`; a clear error
    naming the option when JAX sees fewer."""
    import numpy as np
    from jax.sharding import Mesh

    devices = engine_devices(n)
    if len(devices) < n:
        hint = (f"; on CPU, start with XLA_FLAGS={_FLAG}={n}" if devices[0].platform == "cpu" else "")
        raise ValueError(f"{option}={n} needs {n} devices, JAX sees {len(devices)} ({devices[0].platform}){hint}")
    return Mesh(np.array(devices), (axis,))
