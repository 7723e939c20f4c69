"""Train a checkpoint's MTP head on the model's own greedy continuations, measure how often its drafts are
accepted on held-out prompts, and save it into the checkpoint (mtp.safetensors).

    python scripts/train_mtp.py [--preset small | --model DIR] [--prompt-source random|corpus] [--steps N] [--no-save]
                                [--token-map-size N] [--token-map-only]

1. The engine generates greedy continuations of prompts, never trained on when held out. --prompt-source random
   (the default for a random-weights preset): random token ids, the held-out ones drawn after the training ones from
   the same stream. corpus (the default for a trained target, a `<preset>-lm` checkpoint of
   scripts/train_bench_target.py): windows of the project's text (qnext/bench/text_corpus.py), training prompts at
   seeded offsets of the training files, held-out prompts at fixed offsets of the held-out files.
2. The target's final-normed hidden states h_t come from the dense forward (qnext/model/dense.py: dense_hidden). Slot t
   of the head takes (x_{t+1}, h_t); its label is the target's own next-token distribution at t + 1, lm_head(h_{t+1})
   (on the continuation its argmax is x_{t+2}; on prompt slots it is what the model would have said there).
3. Optionally (--chain-weight) a second pass feeds slot t's own normed hidden state with x_{t+2}, the way the second
   draft is made, and is trained on x_{t+3} (continuation slots only, where x_{t+2} is the model's greedy token).
4. Minibatch Adam with warmup and cosine decay, the decoder frozen, float32.
5. Held out: the head's agreement with the model's greedy token at chain steps 1 and 2, and the acceptance length
   (tokens emitted per verify round, 1 + drafts accepted) of the speculative reference loop
   (qnext/engine/spec_decode_reference.py) for each k, whose tokens must equal plain greedy decoding's.
6. A draft vocabulary (--token-map-size, qnext/model/draft_vocab.py): the most frequent ids of the training
   sequences, written as mtp_token_map.npy for speculative_config's speculative_token_map, with the share of the
   held-out continuations' tokens it holds.
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
    p.add_argument("--preset", default="small", help="bench preset when --model is not given")
    p.add_argument("--out-dir", default="bench_out", help="where bench checkpoints are written")
    p.add_argument("--prompts", type=int, default=1024, help="training prompts")
    p.add_argument("--prompt-source", choices=("auto", "random", "corpus"), default="auto",
                   help="random token ids, or windows of the text corpus (auto: corpus for a -lm checkpoint)")
    p.add_argument("--held-out", type=int, default=64, help="held-out prompts (agreement)")
    p.add_argument("--held-out-loop", type=int, default=4,
                   help="of those, how many the speculative reference loop runs (acceptance length; slow)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=48)
    p.add_argument("--steps", type=int, default=300, help="minibatch Adam steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="peak; linear warmup, then cosine decay")
    p.add_argument("--chain-weight", type=float, default=0.0, help="weight of the chained (second draft) loss")
    p.add_argument("--hard-labels", action="store_true", help="train on the argmax token, not the distribution")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="drafts per verify round to measure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save", action="store_true", help="do not write mtp.safetensors into the checkpoint")
    p.add_argument("--token-map-size", type=int, default=1024,
                   help="write the N most frequent ids of the training continuations as a draft vocabulary "
                        "(mtp_token_map.npy, speculative_config's speculative_token_map); 0: none")
    p.add_argument("--token-map-only", action="store_true", help="write the token map and stop (no training)")
    return p.parse_args(argv)


def prompt_source(choice: str, path) -> str:
    """"random" or "corpus": `choice`, or for "auto" corpus exactly when `path` is a trained-target checkpoint."""
    from qnext.bench.presets import is_lm_checkpoint

    if choice != "auto":
        return choice
    return "corpus" if is_lm_checkpoint(path) else "random"


def draw_prompts(source: str, path, cfg, n: int, held_out: int, prompt_len: int, seed: int) -> list[list[int]]:
    """n training prompts then `held_out` held-out prompts of prompt_len tokens. random: one seeded stream of token
    ids (held-out ones drawn after the training ones); corpus: training-file windows at offsets drawn from `seed`,
    then held-out-file windows at fixed offsets (qnext/bench/text_corpus.py)."""
    if source == "random":
        return np.random.default_rng(seed).integers(3, cfg.vocab_size, (n + held_out, prompt_len)).tolist()
    from qnext.bench.text_corpus import load_corpus

    corpus = load_corpus(path)
    return corpus.training_prompts(n, prompt_len, seed) + corpus.held_out_prompts(held_out, prompt_len)


def continuations(path, cfg, params, prompts: list[list[int]], gen_len: int, spare: int = 8):
    """(token ids [n, prompt_len + gen_len]: the prompts and their greedy continuations, the target's final-normed
    hidden states [n, T, H] over them)."""
    import jax
    import jax.numpy as jnp

    from qnext import LLM, SamplingParams
    from qnext.model.dense import dense_hidden

    n, prompt_len = len(prompts), len(prompts[0])
    llm = LLM(path, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=prompt_len + gen_len + spare)
    greedy = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    seqs = np.array([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], np.int32)
    del llm
    hidden_of = jax.jit(lambda params, ids: dense_hidden(params, ids, None, cfg)[0])
    chunk = 32
    padded = np.concatenate([seqs, np.repeat(seqs[:1], -n % chunk, 0)])
    hidden = np.concatenate([np.asarray(hidden_of(params, jnp.asarray(padded[i:i + chunk])))
                             for i in range(0, len(padded), chunk)])[:n]
    return seqs, hidden


class Trainer:
    """The head's losses, its held-out agreement, and minibatch Adam over (ids [N, T], target hidden [N, T, H])."""

    def __init__(self, params, cfg, prompt_len: int, seq_len: int, *, chain_weight=0.0, hard_labels=False):
        import jax
        import jax.numpy as jnp
        import optax

        from qnext.ops.linear import linear
        from qnext.model.mtp import mtp_forward

        # the decoder's weights go in as arguments: closed over, XLA would constant-fold through them
        self.shared = {"embed": params["embed"], "lm_head": params["lm_head"]}
        T = seq_len
        chain_mask = (np.arange(1, T - 1) + 1 >= prompt_len).astype(np.float32)   # chained slot u: x_{u+1} greedy
        eval_mask = (np.arange(T - 2) + 2 >= prompt_len).astype(np.float32)       # slot t: x_{t+2} generated

        def loss_fn(mtp, shared, ids, h):                     # ids [B, T], h [B, T, H]
            target = jax.lax.stop_gradient(linear(h[:, 1:], shared["lm_head"], preferred_element_type=jnp.float32))
            labels = (jax.nn.one_hot(target.argmax(-1), target.shape[-1]) if hard_labels
                      else jax.nn.softmax(target))           # [B, T-1, V]: the target at positions 1..T-1
            logits1, own = mtp_forward(shared, mtp, ids[:, 1:], h[:, :-1], cfg)
            loss = optax.softmax_cross_entropy(logits1, labels).mean()
            if chain_weight:
                logits2, _ = mtp_forward(shared, mtp, ids[:, 2:], own[:, :-1], cfg)
                ce2 = optax.softmax_cross_entropy(logits2, labels[:, 1:])
                loss = loss + chain_weight * (ce2 * chain_mask).sum() / (chain_mask.sum() * ids.shape[0])
            return loss

        def agreement(mtp, shared, ids, h):
            logits1, own = mtp_forward(shared, mtp, ids[:, 1:-1], h[:, :-2], cfg)
            hit1 = (logits1.argmax(-1) == ids[:, 2:]).astype(jnp.float32)
            logits2, _ = mtp_forward(shared, mtp, ids[:, 2:-1], own[:, :-1], cfg)
            hit2 = (logits2.argmax(-1) == ids[:, 3:]).astype(jnp.float32)
            m1, m2 = eval_mask, chain_mask[:-1] * eval_mask[1:]
            return (hit1 * m1).sum() / (m1.sum() * ids.shape[0]), (hit2 * m2).sum() / (m2.sum() * ids.shape[0])

        self.loss_fn, self._agreement = loss_fn, jax.jit(agreement)

    def agreement(self, mtp, ids, hidden) -> tuple[float, float]:
        """Agreement with the greedy continuation at chain steps 1 and 2 (the first and second draft)."""
        import jax.numpy as jnp

        a1, a2 = self._agreement(mtp, self.shared, jnp.asarray(ids), jnp.asarray(hidden))
        return float(a1), float(a2)

    def train(self, mtp, ids, hidden, *, steps: int, batch: int, learning_rate: float, seed: int = 0,
              report=None):
        import jax
        import jax.numpy as jnp
        import optax

        schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 20), steps,
                                                      learning_rate * 0.05)
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
        state = opt.init(mtp)

        @jax.jit
        def step(mtp, state, shared, ids, h):
            loss, grads = jax.value_and_grad(self.loss_fn)(mtp, shared, ids, h)
            updates, state = opt.update(grads, state, mtp)
            return optax.apply_updates(mtp, updates), state, loss

        order = np.random.default_rng(seed + 1)
        perm, pos = order.permutation(len(ids)), 0
        for i in range(steps):
            if pos + batch > len(ids):
                perm, pos = order.permutation(len(ids)), 0
            idx = np.sort(perm[pos:pos + batch])
            pos += batch
            mtp, state, loss = step(mtp, state, self.shared, jnp.asarray(ids[idx]), jnp.asarray(hidden[idx]))
            if report:
                report(i + 1, mtp, float(loss))
        return mtp


def text_agreement(params, mtp, cfg, windows: np.ndarray, chunk: int = 16) -> tuple[float, float]:
    """On real text (windows [N, T] of the corpus, teacher-forced, not the model's own continuation): (how often the
    head's first draft at slot t, from (x_{t+1}, h_t), is the target's greedy token at t + 1; how often the target's
    greedy token is the text's next token). A greedy continuation can fall into repeats a head copies easily; this
    scores the head where the context is text the target did not write."""
    import jax
    import jax.numpy as jnp

    from qnext.model.dense import dense_hidden
    from qnext.model.mtp import mtp_forward

    @jax.jit
    def hits(params, mtp, ids):
        h, logits = dense_hidden(params, ids, None, cfg)
        greedy = logits.argmax(-1)                                       # [B, T]: the target's token for t + 1
        draft, _ = mtp_forward(params, mtp, ids[:, 1:], h[:, :-1], cfg)  # slot t: x_{t+1}, h_t -> x_{t+2}
        return (draft.argmax(-1) == greedy[:, 1:]).sum(), (greedy[:, :-1] == ids[:, 1:]).sum()

    counts = np.zeros(2)
    for i in range(0, len(windows), chunk):
        counts += [int(x) for x in hits(params, mtp, jnp.asarray(windows[i:i + chunk]))]
    slots = len(windows) * (windows.shape[1] - 1)
    return float(counts[0] / slots), float(counts[1] / slots)


def acceptance_lengths(params, mtp, cfg, prompts, gen_len: int, ks) -> dict[int, tuple[float, int]]:
    """{k: (mean tokens per verify round, rounds)} of the speculative reference loop over the prompts; raises if its
    tokens differ from plain greedy decoding's."""
    from qnext.engine.spec_decode_reference import mtp_draft, plain_greedy, speculative_greedy, target_forward

    length = len(prompts[0]) + gen_len + max(ks) + 1
    draft, target = mtp_draft(params, mtp, cfg, length), target_forward(params, cfg)
    want = [plain_greedy(params, cfg, p, gen_len, length, target) for p in prompts]
    out = {}
    for k in ks:
        accepted = []
        for prompt, w in zip(prompts, want):
            got, acc = speculative_greedy(params, cfg, prompt, gen_len, k, draft, length, target)
            if got != w:
                raise AssertionError(f"speculative decoding with k={k} changed the greedy tokens of {prompt}")
            accepted += acc
        out[k] = (1 + float(np.mean(accepted)), len(accepted))
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not 0 <= args.held_out_loop <= args.held_out:
        raise ValueError(f"--held-out-loop {args.held_out_loop} must be within 0..--held-out {args.held_out}")
    import jax

    from qnext.bench.presets import bench_checkpoint
    from qnext.model.checkpoint import load_checkpoint
    from qnext.model.mtp import init_mtp_params, save_mtp_params

    start = time.perf_counter()
    path = Path(args.model) if args.model else bench_checkpoint(args.preset, args.out_dir)
    checkpoint = load_checkpoint(path)
    cfg, params = checkpoint.config, checkpoint.params
    n = args.prompts
    source = prompt_source(args.prompt_source, path)
    prompts = draw_prompts(source, path, cfg, n, args.held_out, args.prompt_len, args.seed)
    seqs, hidden = continuations(path, cfg, params, prompts, args.gen_len, spare=max(args.k) + 8)
    held_ids, held_h = seqs[n:], hidden[n:]
    data_s = time.perf_counter() - start
    token_map = write_token_map(path, seqs[:n], held_ids[:, args.prompt_len:], args) if args.token_map_size else None
    if args.token_map_only:
        return {"token_map": token_map}
    trainer = Trainer(params, cfg, args.prompt_len, seqs.shape[1], chain_weight=args.chain_weight,
                      hard_labels=args.hard_labels)
    mtp = init_mtp_params(params, cfg, jax.random.key(args.seed))
    before = trainer.agreement(mtp, held_ids, held_h)
    print(f"{len(seqs)} greedy continuations of {source} prompts and their hidden states ({data_s:.0f} s); "
          f"held-out agreement before training: first draft {before[0]:.3f}, chained second {before[1]:.3f}")
    t0 = time.perf_counter()

    def report(i, mtp, loss):
        if i % max(1, args.steps // 8) == 0:
            a1, a2 = trainer.agreement(mtp, held_ids, held_h)
            print(f"step {i}: loss {loss:.4f}, held-out agreement {a1:.3f} / {a2:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)

    mtp = trainer.train(mtp, seqs[:n], hidden[:n], steps=args.steps, batch=args.batch,
                        learning_rate=args.learning_rate, seed=args.seed, report=report)
    train_min = (time.perf_counter() - t0) / 60
    after = trainer.agreement(mtp, held_ids, held_h)
    print(f"trained {args.steps} steps of {args.batch} sequences in {train_min:.1f} min; held-out ({args.held_out} "
          f"prompts) agreement: first draft {after[0]:.3f} (before {before[0]:.3f}), chained second {after[1]:.3f}")
    text = None
    if source == "corpus":
        from qnext.bench.text_corpus import load_corpus

        windows = load_corpus(path).held_out_windows(args.held_out, args.prompt_len + args.gen_len)
        text = text_agreement(params, mtp, cfg, windows)
        print(f"on held-out text (teacher-forced, {windows.shape[0]} windows of {windows.shape[1]}): the head's first "
              f"draft is the target's greedy token {text[0]:.3f} of the time (before training "
              f"{text_agreement(params, init_mtp_params(params, cfg, jax.random.key(args.seed)), cfg, windows)[0]:.3f}"
              f"); the target's greedy token is the text's next {text[1]:.3f}")
    acceptance = {}
    if args.held_out_loop:
        loop = held_ids[:args.held_out_loop, :args.prompt_len].tolist()
        acceptance = acceptance_lengths(params, mtp, cfg, loop, args.gen_len, args.k)
        for k, (a, rounds) in acceptance.items():
            print(f"k={k}: acceptance length {a:.2f} tokens per verify round ({rounds} rounds over {len(loop)} "
                  f"held-out prompts; tokens equal plain greedy)")
    if not args.no_save:
        print(f"saved {save_mtp_params(path, mtp, cfg)}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return {"prompt_source": source, "agreement_before": before[0], "agreement_after": after[0],
            "chained_agreement": after[1], "text_agreement": text[0] if text else None,
            "acceptance_length": {k: a for k, (a, _) in acceptance.items()}, "train_minutes": train_min,
            "token_map": token_map}


def write_token_map(path: Path, training: np.ndarray, held_out: np.ndarray, args) -> dict:
    """The draft vocabulary (qnext/model/draft_vocab.py): the --token-map-size most frequent ids of the training
    prompts and their greedy continuations, and the share of the held-out continuations' tokens it holds."""
    from qnext.model.draft_vocab import TOKEN_MAP_FILE, coverage, frequent_tokens

    ids = frequent_tokens(training.tolist(), args.token_map_size)
    share = coverage(ids, held_out.tolist())
    out = path / TOKEN_MAP_FILE
    if not args.no_save:
        np.save(out, ids)
    print(f"draft token map: the {len(ids)} most frequent ids of the training sequences hold {share:.3f} of the "
          f"held-out continuations' tokens" + ("" if args.no_save else f"; saved {out}"), flush=True)
    return {"size": int(len(ids)), "held_out_coverage": share, "path": None if args.no_save else str(out)}


if __name__ == "__main__":
    main()
