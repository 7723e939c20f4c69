"""Data parallel replica processes get the devices they were assigned or do not start (qnext/server/replica_devices.py),
tested without GPUs: the assignment from CUDA_VISIBLE_DEVICES / JAX_PLATFORMS, too few GPUs refused before any
replica starts, a replica whose JAX reports another platform or device count refused with both named, and a real
replica process pinned to GPUs on this CPU-only machine refusing to start instead of serving on the CPU."""
from __future__ import annotations

import pytest

from qnext.server.replica_devices import ReplicaDevices, assign_replica_devices


def test_each_replica_gets_its_own_slice_of_the_visible_gpus():
    replicas = assign_replica_devices(2, 2, {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in replicas] == ["4,5", "6,7"]
    assert all(r.platform == "gpu" and r.count == 2 and r.env["JAX_PLATFORMS"] == "cuda" for r in replicas)


def test_too_few_visible_gpus_are_refused_before_any_replica_starts():
    with pytest.raises(ValueError, match="--data-parallel-size 2 x tensor_parallel_size 2 needs 4 GPUs; "
                                         "CUDA_VISIBLE_DEVICES=0,1,2 lists 3"):
        assign_replica_devices(2, 2, {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0,1,2"})


def test_on_the_cpu_each_replica_gets_its_own_host_devices():
    replicas = assign_replica_devices(2, 3, {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/x "
                                             "--xla_force_host_platform_device_count=8"})
    assert all(r.platform == "cpu" and r.count == 3 for r in replicas)
    assert replicas[1].env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3"


def test_a_replica_that_landed_elsewhere_is_refused_naming_both():
    given = ReplicaDevices(1, "gpu", 2, {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "2,3"})
    given.check("gpu", 2)
    with pytest.raises(ValueError, match=r"replica 1 was given 2 GPUs \(CUDA_VISIBLE_DEVICES=2,3\) but JAX runs it "
                                         "on 1 cpu device"):
        given.check("cpu", 1)
    with pytest.raises(ValueError, match="on 1 gpu device"):
        given.check("cuda", 1)


def test_a_replica_process_without_its_gpus_refuses_to_start(tmp_path):
    """No GPU here: a replica pinned to one fails before loading anything (the model path is never read)."""
    from qnext.server.replica_process import ProcessReplica

    given = ReplicaDevices(0, "gpu", 1, {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0"})
    replica = ProcessReplica(given, str(tmp_path / "no-model"), {}, max_waiting_requests=4, warm_up=False,
                             log_level="error")
    try:
        with pytest.raises(ValueError, match=r"replica 0 was given 1 GPU \(CUDA_VISIBLE_DEVICES=0\) but JAX could "
                                             "not start on them"):
            replica.wait_ready(timeout=120)
        replica.process.join(30)
        assert replica.process.exitcode == 2
    finally:
        replica.stop(timeout=5)
