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
