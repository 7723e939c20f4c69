"""Train a checkpoint's MTP head on the model's own greedy continuations, measure how often its drafts are
accepted on held-out prompts, and save it into the checkpoint (mtp.safetensors).

    python scripts/train_mtp.py [--preset small | --model DIR] [--steps 300] [--k 2] [--no-save]

1. The engine generates greedy continuations of random prompts (train and held-out sets).
2. The target's final-normed hidden states come from the dense forward (qnext/model/mtp.py: dense_hidden); the head
   (initialised from the decoder's last full-attention layer, fc passing the hidden state through) is trained with
   optax Adam on cross-entropy of x_{t+2} from (x_{t+1}, h_t) over the continuations, the decoder frozen.
3. Held out: the head's one-step agreement with the model's greedy token (the acceptance rate of the first draft),
   and the acceptance length (tokens emitted per verify round, 1 + drafts accepted) of the speculative reference
   loop with k drafts (qnext/engine/spec_decode_reference.py), whose tokens must equal plain greedy decoding's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the --preset bench checkpoint)")
    p.add_argument("--preset", default="tiny", help="bench preset when --model is not given")
    p.add_argument("--out-dir", default="bench_out", help="where bench checkpoints are written")
    p.add_argument("--prompts", type=int, default=1024, help="training prompts")
    p.add_argument("--held-out", type=int, default=8, help="held-out prompts")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=80, help="full-batch Adam steps (more overfit the tiny demo)")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--k", type=int, default=2, help="drafts per verify round in the acceptance measurement")
    p.add_argument("--no-save", action="store_true", help="do not write mtp.safetensors into the checkpoint")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import optax

    from qnext import LLM, SamplingParams
    from qnext.bench.presets import bench_checkpoint
    from qnext.config import ModelConfig
    from qnext.engine.spec_decode_reference import mtp_draft, plain_greedy, speculative_greedy
    from qnext.model.loader import load_params
    from qnext.model.mtp import dense_hidden, init_mtp_params, mtp_forward, save_mtp_params

    start = time.perf_counter()
    path = Path(args.model) if args.model else bench_checkpoint(args.preset, args.out_dir)
    cfg = ModelConfig.from_pretrained(path)
    params = load_params(path, cfg)
    total, p_len = args.prompts + args.held_out, args.prompt_len
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, (total, p_len)).tolist()
    llm = LLM(path, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=p_len + args.gen_len + args.k + 8)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    seqs = np.array([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], np.int32)   # [N, T]
    del llm
    train, held = seqs[:args.prompts], seqs[args.prompts:]
    hidden_of = jax.jit(lambda params, ids: dense_hidden(params, ids, cfg)[0])
    h_train, h_held = hidden_of(params, jnp.asarray(train)), hidden_of(params, jnp.asarray(held))
    # slot t: (x_{t+1}, h_t) -> x_{t+2}; the loss and agreement cover slots whose label is a generated token

    # the decoder's weights go in as arguments: closed over, XLA would constant-fold through them
    shared = {"embed": params["embed"], "lm_head": params["lm_head"]}

    def loss_fn(mtp, shared, ids, hidden):
        logits, _ = mtp_forward(shared, mtp, ids[:, 1:-1], hidden[:, :-2], cfg)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 2:])
        mask = (jnp.arange(ids.shape[1] - 2) + 2 >= p_len).astype(jnp.float32)
        return (ce * mask).sum() / (mask.sum() * ids.shape[0])

    @jax.jit
    def agreement(mtp, shared, ids, hidden):
        logits, _ = mtp_forward(shared, mtp, ids[:, 1:-1], hidden[:, :-2], cfg)
        hit = (jnp.argmax(logits, -1) == ids[:, 2:]).astype(jnp.float32)
        mask = (jnp.arange(ids.shape[1] - 2) + 2 >= p_len).astype(jnp.float32)
        return (hit * mask).sum() / (mask.sum() * ids.shape[0])

    mtp = init_mtp_params(params, cfg, jax.random.key(0))
    opt = optax.adam(args.learning_rate)
    state = opt.init(mtp)

    @jax.jit
    def step(mtp, state, shared, ids, hidden):
        loss, grads = jax.value_and_grad(loss_fn)(mtp, shared, ids, hidden)
        updates, state = opt.update(grads, state, mtp)
        return optax.apply_updates(mtp, updates), state, loss

    held_ids = jnp.asarray(held)
    before = float(agreement(mtp, shared, held_ids, h_held))
    print(f"held-out first-draft agreement before training: {before:.3f}")
    ids = jnp.asarray(train)
    for i in range(args.steps):
        mtp, state, loss = step(mtp, state, shared, ids, h_train)
        if (i + 1) % max(1, args.steps // 6) == 0:
            print(f"step {i + 1}: loss {float(loss):.4f}, held-out agreement "
                  f"{float(agreement(mtp, shared, held_ids, h_held)):.3f}")
    after = float(agreement(mtp, shared, held_ids, h_held))

    length = p_len + args.gen_len + args.k + 1
    draft = mtp_draft(params, mtp, cfg, length)
    accepted, equal = [], True
    for p in held.tolist():
        prompt = p[:p_len]
        got, acc = speculative_greedy(params, cfg, prompt, args.gen_len, args.k, draft, length)
        equal &= got == plain_greedy(params, cfg, prompt, args.gen_len, length)
        accepted += acc
    acceptance_length = 1 + float(np.mean(accepted))
    print(f"held-out first-draft agreement after training: {after:.3f} (before {before:.3f})")
    print(f"acceptance length with k={args.k}: {acceptance_length:.2f} tokens per verify round "
          f"({len(accepted)} rounds; tokens equal plain greedy: {equal})")
    if not args.no_save:
        print(f"saved {save_mtp_params(path, mtp, cfg)}")
    print(f"{time.perf_counter() - start:.0f} s")
    return {"agreement_before": before, "agreement_after": after, "acceptance_length": acceptance_length,
            "tokens_equal": equal}


if __name__ == "__main__":
    main()
