"""scripts/bench_mtp.py end to end on a tiny checkpoint with an MTP head: every configuration it runs (plain, head
drafts, oracle drafts, disable_by_batch_size) emits plain decoding's tokens, oracle drafts are all accepted, and the
report holds the figures the README table is made of."""
from __future__ import annotations

import jax
import numpy as np

from qnext.config import ModelConfig
from qnext.model.draft_vocab import TOKEN_MAP_FILE
from qnext.model.loader import load_params
from qnext.model.mtp import init_mtp_params, save_mtp_params
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from scripts import bench_mtp


def test_bench_mtp_rows_equal_plain_tokens_and_oracle_drafts_are_accepted(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5")
    cfg = ModelConfig.from_pretrained(path)
    save_mtp_params(path, init_mtp_params(load_params(path, cfg), cfg, jax.random.key(0)), cfg)
    np.save(path / TOKEN_MAP_FILE, np.arange(cfg.vocab_size - 1, 99, -1))     # auto: the checkpoint's own map
    report = bench_mtp.main(["--model", str(path), "--batches", "1,3", "--k", "2", "--rounds", "2",
                             "--repeats", "1", "--output-len", "8", "--prompt-len", "6",
                             "--disable-by-batch-size", "2"])
    rows = {(r["batch"], r["drafts"]): r for r in report["rows"]}
    kinds = ("head", "oracle", "head, disable_by_batch_size=2", f"head, token map {cfg.vocab_size - 100}")
    assert set(rows) == {(b, d) for b in (1, 3) for d in kinds}
    assert all(r["tokens_equal"] and r["plain_tok_s"] > 0 and r["mtp_tok_s"] > 0 for r in rows.values())
    for r in rows.values():       # decode only: tokens after the first over the time after the prefill steps
        assert r["plain_decode_tok_s"] > 0 and r["decode_speedup"] == r["mtp_decode_tok_s"] / r["plain_decode_tok_s"]
    for b in (1, 3):
        oracle = rows[(b, "oracle")]                   # every draft agrees: k + 1 tokens a round but at the end
        assert oracle["acceptance_length"] > 2.0 and oracle["t_spec_ms"] > 0
    assert rows[(3, "head, disable_by_batch_size=2")]["steps"]["spec"] == 0   # 3 rows: never speculative
    assert rows[(1, "head, disable_by_batch_size=2")]["steps"]["spec"] > 0
