"""Several processes, one engine: JAX's multi-controller runtime over every process's devices (multiprocess.py)."""
