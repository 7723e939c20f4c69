"""Context-parallel prefill of the Gated DeltaNet (qnext/model/context_parallel.py) equals the sequential layer on
2 and 4 XLA host devices, both families, and exchanges state-sized bytes whatever the length.

Runs in a subprocess started with 4 CPU devices (the flag must be set before JAX starts; this process has one).
Tolerance: max |CP - sequential| <= 2e-5 on layer outputs of magnitude ~1 (float32; the fold and the correction
reorder sums of the scan), and <= 1e-4 relative on the end state carried in from a nonzero initial state."""
from __future__ import annotations

import textwrap

from tests.support.host_device_script import run_on_host_devices

_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import qnext
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from qnext.model.context_parallel import context_parallel_deltanet, shard_delta_rule
    from qnext.model.dense import dense_gated_deltanet
    from qnext.model.dense_delta_rule import dense_gated_delta_rule_with_state
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    out = {"devices": len(jax.devices())}
    for seed, family in enumerate(("qwen3_5", "qwen3_next")):
        # each family's checkpoint layout (Qwen3-Next's packed in_proj_qkvz / in_proj_ba) through the loader
        path = write_tiny_checkpoint(sys.argv[1] + "/" + family, family, seed=seed, linear_num_key_heads=1)
        model = qnext.load_model(path)                                                  # Hv / Hk = 4
        cfg, p = model.config, model.params["layers"][0]["attn"]
        x = jax.random.normal(jax.random.key(2), (2, 384, cfg.hidden_size), jnp.float32)
        ref = jax.jit(lambda p, x: dense_gated_deltanet(p, x, jnp.ones(x.shape[:2], bool), cfg))(p, x)
        for n in (2, 4):
            # jitted, as a prefill step would call it (eager, the shard_map took ~5x as long on 2 cores); the
            # inputs start on the mesh where the function puts them (jit refuses ones committed to device 0)
            mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
            on_mesh = jax.device_put((p, x), NamedSharding(mesh, P()))
            got = jax.jit(lambda p, x: context_parallel_deltanet(p, x, cfg, mesh, chunk=32))(*on_mesh)
            got, want = np.asarray(got), np.asarray(ref)
            out[f"{family}/{n}"] = [float(np.abs(got - want).max()), float(np.abs(want).max())]

    # the core from a nonzero state: outputs and the end state; the all-gather's operand is state-sized
    rng = np.random.default_rng(0)
    def inputs(t):
        q = rng.normal(size=(1, t, 2, 16)); k = rng.normal(size=(1, t, 2, 16))
        q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) for a in (q, k))
        return (jnp.asarray(q * 0.25, jnp.float32), jnp.asarray(k, jnp.float32),
                jnp.asarray(rng.normal(size=(1, t, 4, 16)), jnp.float32),
                jnp.asarray(-rng.uniform(0.01, 0.3, (1, t, 4)), jnp.float32),
                jnp.asarray(rng.uniform(0.1, 0.9, (1, t, 4)), jnp.float32))
    s0 = jnp.asarray(rng.normal(size=(1, 4, 16, 16)), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    gathered = {}
    seq = P(None, "context")
    fn = jax.shard_map(lambda q, k, v, g, b, s: shard_delta_rule(q, k, v, g, b, "context", s, 32), mesh=mesh,
                       in_specs=(seq,) * 5 + (P(),), out_specs=(seq, P()), check_vma=False)
    args = inputs(256)
    ref_o, ref_s = jax.jit(dense_gated_delta_rule_with_state, static_argnums=6)(*args, s0, 32)
    o, s = jax.jit(fn)(*args, s0)
    out["core"] = [float(jnp.abs(o - ref_o).max()), float(jnp.abs(ref_o).max()),
                   float(jnp.abs(s - ref_s).max() / jnp.abs(ref_s).max())]
    for t in (256, 1024):                                   # lowered only: what the all-gather moves
        text = jax.jit(fn).lower(*inputs(t), s0).as_text()
        gathered[t] = sorted({line.split("->")[0].split(":")[-1].strip() for line in text.splitlines()
                              if "all_gather" in line or "all-gather" in line})
    out["gathered"] = gathered
    print(json.dumps(out))
""")


def test_context_parallel_deltanet_equals_sequential_on_2_and_4_devices(tmp_path):
    out = run_on_host_devices(_SCRIPT, 4, str(tmp_path), timeout=600)
    assert out["devices"] == 4
    for family in ("qwen3_5", "qwen3_next"):
        for n in (2, 4):
            diff, scale = out[f"{family}/{n}"]
            assert scale > 0.1 and diff <= 2e-5, (family, n, diff, scale)
    diff, scale, state_rel = out["core"]
    assert scale > 0.1 and diff <= 2e-5 * scale and state_rel <= 1e-4, (diff, scale, state_rel)
    # the exchange is the same [1, Hv, dk, dv + dk] array per device at 256 and 1024 tokens
    assert out["gathered"]["256"] == out["gathered"]["1024"] != [], out["gathered"]
