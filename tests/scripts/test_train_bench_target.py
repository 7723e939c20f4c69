"""The bench's trained target: the text corpus (qnext/bench/text_corpus.py) is deterministic and its held-out files
are never training files, and scripts/train_bench_target.py on the tiny preset lowers the training loss in a few
steps and writes a checkpoint qnext.LLM loads and generates from."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from qnext import LLM, SamplingParams
from qnext.bench.presets import bench_checkpoint, is_lm_checkpoint, lm_checkpoint_dir
from qnext.bench.text_corpus import HELD_OUT_EVERY, corpus_files, load_corpus, split_files
from scripts import train_bench_target


def test_corpus_split_is_by_file_disjoint_and_deterministic(tmp_path):
    files = corpus_files()
    assert files == corpus_files() and files == sorted(files, key=lambda p: p.as_posix())
    assert Path("README.md") in files and Path("qnext/bench/text_corpus.py") in files
    assert not any("__pycache__" in f.parts or f.parts[0] in (".venv", "shared") for f in files)
    train, held = split_files(files)
    assert not set(train) & set(held) and sorted(train + held) == sorted(files)
    assert len(files) // (3 * HELD_OUT_EVERY) < len(held) < 3 * len(files) // HELD_OUT_EVERY
    assert split_files(files[::2]) == ([f for f in train if f in files[::2]], [f for f in held if f in files[::2]])

    corpus = load_corpus(bench_checkpoint("tiny", tmp_path))
    assert set(corpus.train_files) == {f.as_posix() for f in train}
    assert set(corpus.held_out_files) == {f.as_posix() for f in held}
    assert len(corpus.train) > 2 * len(corpus.held_out) > 0
    windows = corpus.training_windows(4, 32, np.random.default_rng(7))
    np.testing.assert_array_equal(windows, corpus.training_windows(4, 32, np.random.default_rng(7)))
    assert corpus.held_out_prompts(3, 16) == corpus.held_out_prompts(3, 16)
    assert [len(p) for p in corpus.training_prompts(5, 16, seed=1)] == [16] * 5


def test_train_bench_target_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    result = train_bench_target.main(
        ["--preset", "tiny", "--out-dir", str(tmp_path), "--steps", "12", "--batch", "4", "--seq-len", "32",
         "--eval-every", "4", "--eval-windows", "4", "--sample-len", "0", "--learning-rate", "3e-3"])
    path = result["path"]
    assert path == lm_checkpoint_dir("tiny", tmp_path) and is_lm_checkpoint(path)
    (_, first_train, _), (_, last_train, last_held) = result["history"][0], result["history"][-1]
    assert last_train < first_train - 0.2 and last_held < result["init_held_out_loss"], result["history"]
    with LLM(path, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64) as llm:
        out = llm.generate(["def main("], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6 and isinstance(out.outputs[0].text, str)
