"""save_pretrained writes checkpoints in their source's layout that transformers and qnext load with the module's
logits; orbax checkpoints a model + optimizer state."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

import qnext  # noqa: E402
import qnext.flax as qflax  # noqa: E402
from flax import nnx  # noqa: E402
from tests.support.flax_fixtures import forward, hf_checkpoint, left_padded_batch  # noqa: E402
from tests.support.hf_reference import FAMILIES  # noqa: E402


def read_tensors(path):
    from safetensors.numpy import load_file

    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize("family,options", [
    ("qwen3_next", {}),
    ("qwen3_5", {"vlm": True, "tie_word_embeddings": True}),          # model.language_model.*, model.visual.*
    ("qwen3_5_moe", {"vlm": True, "fused_experts": True}),             # experts.gate_up_proj [E, 2I, H]
    ("qwen3_5_moe", {"num_shards": 2}),
])
def test_saving_an_unchanged_model_reproduces_its_checkpoint(tiny_checkpoint, tmp_path, family, options):
    source = tiny_checkpoint(family, **options)
    out = qflax.save_pretrained(qflax.from_pretrained(source), tmp_path / "saved", max_shard_bytes=400_000)
    want, got = read_tensors(source), read_tensors(out)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    for f in source.iterdir():                                        # tokenizer and generation config
        if f.suffix == ".json" and not f.name.startswith(("config", "model")):
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert (out / "model.safetensors.index.json").exists()            # 400 kB shards


@pytest.mark.parametrize("family", FAMILIES)
def test_a_changed_model_saves_what_transformers_and_qnext_load_with_its_logits(family, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = qflax.from_pretrained(hf_checkpoint(family)[1])
    rng = np.random.default_rng(4)
    nnx.update(model, jax.tree.map(lambda p: p + 0.02 * rng.standard_normal(p.shape, np.float32),   # new weights
                                   nnx.state(model, nnx.Param)))
    ids, mask = left_padded_batch(model.config.vocab_size, seed=5)
    ours = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))[0]

    out = qflax.save_pretrained(model, tmp_path / "saved")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids[:1], dtype=torch.long)).logits[0].numpy()
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    engine = qnext.load_model(out).logits(ids[0])
    assert np.abs(ours - engine).max() < 1e-4, np.abs(ours - engine).max()


def test_orbax_restores_a_model_and_optimizer_state(tmp_path):
    import optax
    import orbax.checkpoint as ocp

    path = hf_checkpoint("qwen3_5")[1]
    model = qflax.from_pretrained(path)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    grads = jax.tree.map(lambda p: jnp.sin(p * 7.0), nnx.state(model, nnx.Param))   # stand-in gradients
    update = nnx.jit(lambda optimizer, model, grads: optimizer.update(model, grads))
    update(optimizer, model, grads)
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "step_1", state)
        checkpointer.wait_until_finished()

        fresh = qflax.from_pretrained(path)
        fresh_optimizer = nnx.Optimizer(fresh, optax.adamw(1e-2), wrt=nnx.Param)
        abstract = {"model": nnx.state(fresh), "optimizer": nnx.state(fresh_optimizer)}
        restored = checkpointer.restore(tmp_path / "step_1", jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract))
    nnx.update(fresh, restored["model"])
    nnx.update(fresh_optimizer, restored["optimizer"])

    def leaves(*objects):
        return jax.tree.leaves([nnx.state(o) for o in objects])

    assert all(np.array_equal(a, b) for a, b in zip(leaves(model, optimizer), leaves(fresh, fresh_optimizer)))
    assert int(fresh_optimizer.step[...]) == 1
    update(optimizer, model, grads)                      # the next step continues identically from the restore
    update(fresh_optimizer, fresh, grads)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(model), leaves(fresh)))
