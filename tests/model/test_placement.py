"""The one load path and the one placement (qnext/model/checkpoint.py, placement.py): a checkpoint read into the
config and placed params, in-memory params copied onto the engine's device, and updates written in place."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.config import ModelConfig
from qnext.engine.stats import compilations
from qnext.model.checkpoint import load_checkpoint
from qnext.model.host_devices import engine_devices
from qnext.model.loader import convert_checkpoint
from qnext.model.mtp import init_mtp_params, load_mtp_params, save_mtp_params
from qnext.model.placement import WeightUpdate, place_params
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from tests.support.trees import assert_same_tree


def leaves(tree):
    return jax.tree.leaves(tree)


def test_load_checkpoint_reads_config_params_and_mtp_head(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5")
    checkpoint = load_checkpoint(path, "bfloat16", with_mtp=True)
    assert checkpoint.config == ModelConfig.from_pretrained(path)
    assert checkpoint.mtp is None                                  # the tiny checkpoint ships no head
    assert_same_tree(checkpoint.params, convert_checkpoint(path, checkpoint.config, "bfloat16"))
    assert all(x.committed and x.devices() == {engine_devices()[0]} for x in leaves(checkpoint.params))

    head = init_mtp_params(checkpoint.params, checkpoint.config, jax.random.key(0))
    save_mtp_params(path, head, checkpoint.config)
    with_head = load_checkpoint(path, "float32", with_mtp=True)
    assert_same_tree(with_head.mtp, load_mtp_params(path, with_head.config))
    assert load_checkpoint(path).mtp is None                       # not asked for


def test_load_checkpoint_says_what_is_wrong(tmp_path, tiny_checkpoint):
    with pytest.raises(ValueError, match="is not a checkpoint directory: config.json is missing"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="cache_dir stores one device's converted params"):
        load_checkpoint(tiny_checkpoint("qwen3_5"), tensor_parallel_size=2, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="enable_expert_parallel needs tensor_parallel_size > 1"):
        load_checkpoint(tiny_checkpoint("qwen3_5_moe"), expert_parallel=True)


def test_place_params_copies_and_casts(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_next")
    cfg = ModelConfig.from_pretrained(path)
    source = jax.tree.map(jnp.asarray, convert_checkpoint(path, cfg, "float32"))
    placed = place_params(source, cfg, "bfloat16")
    assert placed["embed"].dtype == jnp.bfloat16 and placed["layers"][0]["attn"]["A_log"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(placed["embed"], np.float32),
                                  np.asarray(source["embed"].astype(jnp.bfloat16), np.float32))
    same = place_params(source, cfg, "float32")
    assert same["embed"].unsafe_buffer_pointer() != source["embed"].unsafe_buffer_pointer()   # a copy
    assert all(x.committed for x in leaves(same))

    attn = {k: v for k, v in source["layers"][0]["attn"].items() if k != "A_log"}
    with pytest.raises(ValueError, match="the params have no weight layers/0/attn/A_log"):
        place_params({**source, "layers": ({**source["layers"][0], "attn": attn},) + source["layers"][1:]}, cfg,
                     "float32")
    with pytest.raises(ValueError, match=r"weight embed has shape \(512, 1\); the model's config needs \(512, 64\)"):
        place_params({**source, "embed": source["embed"][:, :1]}, cfg, "float32")


def test_weight_update_writes_in_place_and_compiles_once_per_signature(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    cfg = ModelConfig.from_pretrained(path)
    host = convert_checkpoint(path, cfg, "float32")
    placed = place_params(host, cfg, "float32")
    update = WeightUpdate(cfg, "float32")
    new = jax.tree.map(lambda x: x + 1, host)                      # numpy: another signature than the placed
    update.prepare(placed, new)
    buffer, old = placed["embed"].unsafe_buffer_pointer(), placed["embed"]
    start = compilations()
    placed = update(placed, new)
    assert compilations() == start                                 # prepared for this signature
    assert placed["embed"].unsafe_buffer_pointer() == buffer and old.is_deleted()
    assert_same_tree(placed, new)

    halves = jax.tree.map(lambda x: jnp.asarray(x / 2, jnp.bfloat16), host)   # another dtype: compiles its copy
    placed = update(placed, halves)
    assert placed["embed"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(placed["embed"]), np.asarray(halves["embed"], np.float32))
    with pytest.raises(ValueError, match="the engine's structure and shapes"):
        update(placed, jax.tree.map(lambda x: x[..., :1], host))
