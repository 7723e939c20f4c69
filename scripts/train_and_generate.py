"""Train with the engine in the loop: qnext samples, a reward scores, optax steps the Flax model, and
`llm.update_weights(model)` copies the new weights into the engine (in place, nothing recompiles).

    python scripts/train_and_generate.py [--steps 6] [--model DIR]

On the tiny demo checkpoint (random weights) the reward is a toy: the share of generated tokens whose id is in a
target set. Each batch samples a group of `--samples-per-prompt` continuations of every prompt (SamplingParams n:
one prefill per prompt, the samples forked from it). Each step is REINFORCE with a per-token reward (1 for a target token), less the batch's mean as the
baseline: sampled tokens' log-likelihoods weighted by their advantage. The reward before and after training is
measured on the same prompts with the same seeds.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = ["Hi", "The sky is", "Once upon a time", "2 + 2 ="]
TARGET_IDS = range(256, 320)           # 64 of the demo's 512 token ids


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the tiny demo checkpoint)")
    p.add_argument("--steps", type=int, default=6, help="optax steps, each on a fresh batch of samples")
    p.add_argument("--samples-per-prompt", type=int, default=2, help="samples of each prompt in a batch (its n)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=2e-2)
    return p.parse_args(argv)


def main(argv=None) -> tuple[float, float]:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import qnext
    import qnext.flax as qflax
    from qnext import SamplingParams
    from qnext.testing.tiny_checkpoint import demo_checkpoint_dir

    start = time.perf_counter()
    model = qflax.from_pretrained(args.model or demo_checkpoint_dir())
    llm = qnext.LLM.from_model(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    optimizer = nnx.Optimizer(model, optax.adam(args.learning_rate), wrt=nnx.Param)
    target = np.zeros(model.config.vocab_size, bool)
    target[list(TARGET_IDS)] = True
    k = args.samples_per_prompt

    def sample(seed: int):
        """Prompt ids, sampled ids and rewards of one batch: a group of k samples per prompt (n=k: the prompt is
        prefilled once; prompt i's samples have seeds seed + k*i + j)."""
        params = [SamplingParams(n=k, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=seed + k * i)
                  for i in range(len(PROMPTS))]
        outputs = llm.generate(PROMPTS, params)
        samples = [list(c.token_ids) for o in outputs for c in o.outputs]
        prompt_ids = [o.prompt_token_ids for o in outputs for _ in o.outputs]
        return prompt_ids, samples, np.array([target[s].mean() for s in samples])

    @nnx.jit
    def reinforce_step(model, optimizer, ids, mask, generated):
        """ids, mask: [B, T] left-padded prompt + sample; generated: [B, T - 1], 1 where ids[:, 1:] was sampled."""
        def loss_fn(model):
            logp = jax.nn.log_softmax(model(ids, mask)[:, :-1])
            token_logp = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
            reward = jnp.asarray(target)[ids[:, 1:]]
            advantage = reward - (reward * generated).sum() / generated.sum()
            return -(advantage * token_logp * generated).sum() / generated.sum()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def batch(prompt_ids, samples):
        width = max(len(p) + len(s) for p, s in zip(prompt_ids, samples))
        ids, mask, generated = (np.zeros((len(samples), width), np.int32) for _ in range(3))
        for row, (p, s) in enumerate(zip(prompt_ids, samples)):
            ids[row, width - len(p) - len(s):] = p + s
            mask[row, width - len(p) - len(s):] = 1
            generated[row, width - len(s):] = 1
        return jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(generated[:, 1:])

    before = sample(seed=0)[2].mean()
    print(f"reward before training: {before:.3f}")
    for step in range(args.steps):
        prompt_ids, samples, rewards = sample(seed=1000 * (step + 1))
        loss = reinforce_step(model, optimizer, *batch(prompt_ids, samples))
        llm.update_weights(model)
        print(f"step {step + 1}: batch reward {rewards.mean():.3f}, loss {float(loss):+.4f}")
    after = sample(seed=0)[2].mean()
    print(f"reward after training: {after:.3f} (before {before:.3f}; {time.perf_counter() - start:.0f} s)")
    return float(before), float(after)


if __name__ == "__main__":
    main()
