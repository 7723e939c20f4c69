"""Which devices each data parallel replica process gets (`qnext serve --data-parallel-size N`, the process
backend), and the check that it got them.

Replica i gets the devices [i * n, (i + 1) * n) (n: tensor_parallel_size): on GPUs that slice of the GPUs this
process may see (CUDA_VISIBLE_DEVICES), on the CPU n XLA host devices of its own. Left to itself, JAX falls back
to the CPU when a process finds no GPU (the GPUs ran out, a slice past the last one): a replica would then serve,
slowly, on the CPU. So each replica's JAX is pinned to the platform it was given (JAX_PLATFORMS: no fallback), and
before it loads anything the replica compares what JAX gives it (platform, device count) with its assignment and
refuses to start, saying both, when they differ. Too few GPUs listed in CUDA_VISIBLE_DEVICES are refused here,
before any replica starts."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

GPU_PLATFORMS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu"}
GPU_PLUGINS = {"jax_cuda12_plugin": "cuda", "jax_cuda13_plugin": "cuda", "jax_rocm7_plugin": "rocm",
               "jax_rocm60_plugin": "rocm"}


@dataclasses.dataclass(frozen=True)
class ReplicaDevices:
    index: int
    platform: str          # "gpu" | "cpu" | ...: what the replica's devices must be (JAX's device.platform)
    count: int             # how many it must see
    env: dict              # applied in the replica before JAX starts (JAX_PLATFORMS, CUDA_VISIBLE_DEVICES, XLA_FLAGS)

    def describe(self) -> str:
        if self.platform == "gpu":
            return (f"{self.count} GPU{'s' if self.count > 1 else ''} (CUDA_VISIBLE_DEVICES="
                    f"{self.env.get('CUDA_VISIBLE_DEVICES')})")
        return f"{self.count} {self.platform} device{'s' if self.count > 1 else ''}"

    def check(self, platform: str, count: int) -> None:
        """ValueError when JAX gave the replica other devices than it was assigned."""
        platform = GPU_PLATFORMS.get(platform, platform)
        if platform != self.platform or count != self.count:
            raise ValueError(f"data parallel replica {self.index} was given {self.describe()} but JAX runs it on "
                             f"{count} {platform} device{'s' if count != 1 else ''}; give each replica its own "
                             "devices (fewer --data-parallel-size, or more GPUs), or set JAX_PLATFORMS=cpu to serve "
                             "on the CPU on purpose")


def assign_replica_devices(num_replicas: int, per_replica: int, environ=os.environ) -> list[ReplicaDevices]:
    """Every replica's devices; ValueError when CUDA_VISIBLE_DEVICES lists too few GPUs for them all."""
    backend = expected_backend(environ)
    platform = GPU_PLATFORMS.get(backend, backend)
    if platform == "cpu":
        flags = " ".join(f for f in environ.get("XLA_FLAGS", "").split()
                         if not f.startswith("--xla_force_host_platform_device_count"))
        env = {"JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={per_replica}".strip()}
        return [ReplicaDevices(i, "cpu", per_replica, env) for i in range(num_replicas)]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in visible.split(",") if g.strip()] if visible is not None else None
    needed = num_replicas * per_replica
    if gpus is not None and len(gpus) < needed:
        raise ValueError(f"--data-parallel-size {num_replicas} x tensor_parallel_size {per_replica} needs {needed} "
                         f"GPUs; CUDA_VISIBLE_DEVICES={visible} lists {len(gpus)}")
    ids = gpus if gpus is not None else [str(i) for i in range(needed)]   # unlisted: the replica's check finds out
    return [ReplicaDevices(i, platform, per_replica,
                           {"JAX_PLATFORMS": backend,
                            "CUDA_VISIBLE_DEVICES": ",".join(ids[i * per_replica:(i + 1) * per_replica])})
            for i in range(num_replicas)]


def expected_backend(environ=os.environ) -> str:
    """The JAX backend the replicas must run on: the first of JAX_PLATFORMS when set, else the GPU backend whose
    JAX plugin is installed, else the CPU."""
    configured = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if configured:
        return configured[0]
    for plugin, backend in GPU_PLUGINS.items():
        if importlib.util.find_spec(plugin) is not None:
            return backend
    return "cpu"


def check_replica_devices(assigned: ReplicaDevices) -> None:
    """In the replica, before it loads the model: ValueError when JAX cannot start on the assigned platform or gives
    other devices than assigned."""
    import jax

    # JAX read JAX_PLATFORMS when it was imported, which unpickling this process's arguments may have done already
    jax.config.update("jax_platforms", assigned.env["JAX_PLATFORMS"])
    try:
        devices = jax.devices()
    except Exception as e:           # RuntimeError, or an AssertionError when JAX has no such backend at all
        reason = str(e).splitlines()[0] if str(e) else f"no {assigned.env['JAX_PLATFORMS']} backend in this JAX"
        raise ValueError(f"data parallel replica {assigned.index} was given {assigned.describe()} but JAX could not "
                         f"start on them: {reason}") from None
    assigned.check(devices[0].platform, len(devices))
