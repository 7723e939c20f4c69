"""The draft vocabulary (qnext/model/draft_vocab.py, SGLang's speculative_token_map): the map file is checked with
errors that say what is wrong; the head's draft over a map is the map id with the largest logit; train_mtp.py
writes the most frequent ids and their held-out coverage."""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.config import ModelConfig
from qnext.engine.config import EngineConfig
from qnext.model.draft_vocab import TOKEN_MAP_FILE, coverage, frequent_tokens, load_token_map
from qnext.model.forward import lm_logits
from qnext.model.loader import load_params
from qnext.model.mtp_step import draft_argmax
from scripts import train_mtp


def test_map_files_load_and_bad_ones_say_what_is_wrong(tmp_path):
    np.save(tmp_path / "map.npy", np.array([5, 2, 9], np.int64))
    (tmp_path / "map.json").write_text(json.dumps([5, 2, 9]))
    for name in ("map.npy", "map.json"):
        ids = load_token_map(tmp_path / name, vocab_size=10)
        assert ids.dtype == np.int32 and ids.tolist() == [5, 2, 9]
    bad = {"twice.json": ([1, 1], "more than once"), "outside.json": ([3, 10], "outside the vocabulary"),
           "negative.json": ([-1], "outside the vocabulary"), "empty.json": ([], "non-empty"),
           "floats.json": ([1.5], "integer"), "nested.json": ([[1, 2]], "non-empty list")}
    for name, (content, message) in bad.items():
        (tmp_path / name).write_text(json.dumps(content))
        with pytest.raises(ValueError, match=message):
            load_token_map(tmp_path / name, vocab_size=10)
    (tmp_path / "map.txt").write_text("1 2")
    with pytest.raises(ValueError, match=".npy array or a .json list"):
        load_token_map(tmp_path / "map.txt", vocab_size=10)
    with pytest.raises(ValueError, match="not a file"):
        load_token_map(tmp_path / "missing.npy", vocab_size=10)


def test_speculative_config_takes_the_map_path():
    config = EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                              "speculative_token_map": "/x/map.npy"})
    assert config.speculative_token_map == "/x/map.npy"
    assert EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2}).speculative_token_map is None
    with pytest.raises(ValueError, match="speculative_token_map must be the path"):
        EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2, "speculative_token_map": [1]})


def test_frequent_tokens_rank_by_count_then_id_and_coverage_counts_tokens():
    ids = frequent_tokens([[4, 4, 7, 9], [7, 4, 9, 2]], 3)
    assert ids.tolist() == [4, 7, 9]                          # 4: 3 times; 7 and 9 twice (7 first); 2 once
    assert frequent_tokens([[1, 1]], 5).tolist() == [1]
    assert coverage(ids, [[4, 2], [9, 9, 5, 7]]) == pytest.approx(4 / 6)


@pytest.mark.parametrize("tokenizer", ["tiny", "qwen3.5"])
def test_draft_over_a_map_is_the_map_id_with_the_largest_logit(tiny_checkpoint, tokenizer, tmp_path):
    """Also at Qwen3.5's real vocabulary (248,320 rows), with the single-token tags in the map."""
    path = tiny_checkpoint("qwen3_5", tokenizer=tokenizer)
    cfg = ModelConfig.from_pretrained(path)
    params = load_params(path, cfg)
    hidden = jax.random.normal(jax.random.key(0), (6, cfg.hidden_size))
    logits = np.asarray(lm_logits(params, hidden, cfg))
    full = np.asarray(draft_argmax(params, {}, cfg)(hidden))
    assert full.tolist() == logits.argmax(-1).tolist()
    permuted = np.random.default_rng(0).permutation(cfg.vocab_size).astype(np.int32)
    assert np.asarray(draft_argmax(params, {"draft_token_ids": jnp.asarray(permuted)}, cfg)(hidden)).tolist() \
        == full.tolist()                                     # the whole vocabulary in another order: same drafts
    subset = np.array([11, 3, 40, 7] if tokenizer == "tiny" else [248058, 3, 248069, 120_000], np.int32)
    np.save(tmp_path / TOKEN_MAP_FILE, subset)
    assert load_token_map(tmp_path / TOKEN_MAP_FILE, cfg.vocab_size).tolist() == subset.tolist()
    want = subset[logits[:, subset].argmax(-1)]
    assert np.asarray(draft_argmax(params, {"draft_token_ids": jnp.asarray(subset)}, cfg)(hidden)).tolist() \
        == want.tolist()


def test_train_mtp_writes_the_most_frequent_ids_and_their_coverage(tmp_path):
    training = np.array([[5, 5, 6, 8], [5, 6, 1, 1]], np.int32)
    held_out = np.array([[5, 9, 6, 6]], np.int32)
    args = argparse.Namespace(token_map_size=2, no_save=False)
    report = train_mtp.write_token_map(tmp_path, training, held_out, args)
    assert np.load(tmp_path / TOKEN_MAP_FILE).tolist() == [5, 1]     # 5: 3 times, 1 and 6 twice (1 first)
    assert report == {"size": 2, "held_out_coverage": 0.25, "path": str(tmp_path / TOKEN_MAP_FILE)}
