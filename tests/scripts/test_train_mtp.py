"""scripts/train_mtp.py's trainer: the label of slot t (the target's distribution at t + 1) is the token its
agreement is scored on (x_{t+2} of a greedy continuation), and the chained pass is the second draft the reference
loop makes, so a head trained on a few continuations reproduces them, and the speculative reference loop then
accepts nearly all its drafts on them (its tokens checked equal to plain greedy's by acceptance_lengths)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qnext.config import ModelConfig
from qnext.engine.spec_decode_reference import plain_greedy, target_forward
from qnext.model.loader import load_params
from qnext.model.mtp import init_mtp_params
from scripts import train_mtp

PROMPT_LEN, GEN_LEN, N = 4, 12, 4


def test_head_memorises_greedy_continuations_and_keeps_greedy_tokens(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    cfg = ModelConfig.from_pretrained(path)
    params = load_params(path, cfg)
    T = PROMPT_LEN + GEN_LEN
    prompts = np.random.default_rng(3).integers(3, cfg.vocab_size, (N, PROMPT_LEN)).tolist()
    target = target_forward(params, cfg)       # jitted: the continuations and their hidden states, one shape
    seqs = np.array([p + plain_greedy(params, cfg, p, GEN_LEN, T, target) for p in prompts], np.int32)
    hidden = np.concatenate([np.asarray(target(jnp.asarray(seqs[i:i + 1]))[0]) for i in range(N)])

    trainer = train_mtp.Trainer(params, cfg, PROMPT_LEN, T, chain_weight=0.5)
    mtp = init_mtp_params(params, cfg, jax.random.key(0))
    before, _ = trainer.agreement(mtp, seqs, hidden)
    mtp = trainer.train(mtp, seqs, hidden, steps=150, batch=N, learning_rate=1e-2)
    first, second = trainer.agreement(mtp, seqs, hidden)
    assert before < 0.2 and first > 0.9 and second > 0.5, (before, first, second)

    acceptance = train_mtp.acceptance_lengths(params, mtp, cfg, prompts[:1], GEN_LEN, [1, 2])
    assert set(acceptance) == {1, 2}
    for k, (length, rounds) in acceptance.items():   # a memorised prompt: the loop's drafts are the trained ones
        assert 1 + 0.8 * k <= length <= k + 1 and rounds >= GEN_LEN / (k + 1), acceptance
