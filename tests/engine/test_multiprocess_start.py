"""How the ranks of one engine start (qnext/distributed/multiprocess.py, qnext/engine/compilation_cache.py): two JAX
processes on the loopback (gloo, one host device each), each with its own compilation cache directory as on two
hosts, no model.
- rank 1 writes the programs it compiled into its own cache (JAX alone writes from process 0 only, so a rank > 0 on
  a host of its own compiled everything at every start);
- the start barrier holds rank 0 until the slower rank arrives (rank 1 "warms up" 2 s longer), and a barrier a rank
  never reaches fails on the other within its deadline, naming it.
The processes always stop: bounded waits, killed in `finally`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from qnext.server.launch import free_port

ROOT = Path(__file__).resolve().parents[2]

_RANK = """
import json, os, sys, time
import numpy as np
rank, address, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
from qnext.distributed.multiprocess import (DistributedConfig, RanksNotReadyError, initialize,
                                            wait_for_every_rank)
initialize(DistributedConfig(nnodes=2, node_rank=rank, dist_init_addr=address), timeout_s=60, serving=True)
from qnext.engine.compilation_cache import enable_compilation_cache
used = enable_compilation_cache(cache)
from jax.experimental import multihost_utils
multihost_utils.broadcast_one_to_all(np.arange(4))             # one program over both processes
time.sleep(2.0 * rank)                                         # rank 1 warms up longer
start = time.monotonic()
wait_for_every_rank("warmed up", 60)
waited = time.monotonic() - start
error = None
if rank == 0:                                                  # rank 1 never comes to this one
    try:
        wait_for_every_rank("at the second barrier", 1.5)
    except RanksNotReadyError as e:
        error = str(e)
    time.sleep(5.0)                                            # rank 1 leaves first: the service is rank 0's
else:
    time.sleep(4.0)
print(json.dumps({"cache": used, "waited": waited, "error": error}), flush=True)
os._exit(0)
"""


def test_ranks_fill_their_own_cache_and_start_together(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=str(ROOT))
    address = f"127.0.0.1:{free_port()}"
    caches = [tmp_path / f"host{rank}" for rank in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), address, str(caches[rank])], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for rank, (p, (out, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {rank}: {err[-3000:]}"
    rank0, rank1 = (json.loads(out.strip().splitlines()[-1]) for out, _ in results)
    assert rank1["cache"] == str(caches[1] / "rank-1") and rank0["cache"] == str(caches[0])
    assert any(caches[0].iterdir()), "rank 0 wrote no cache entry"
    assert any(Path(rank1["cache"]).iterdir()), "rank 1 wrote no cache entry: it would compile at every start"
    assert rank0["waited"] > 1.5, rank0            # held until rank 1 was ready
    assert "not every rank was at the second barrier within 1.5 s" in rank0["error"], rank0
