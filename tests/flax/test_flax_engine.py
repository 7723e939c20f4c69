"""A Flax model and the engine in one training loop: `LLM.from_model(model)` serves the module's weights and
`llm.update_weights(model)` copies new ones in place, with no compilation, dropping the prefix cache.

One warmed engine (two layers: a DeltaNet and an attention layer) serves every test here; each test that changes
its weights puts the fixture module's back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qnext
import qnext.flax as qflax
from qnext import SamplingParams
from qnext.engine.stats import compilations

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, block_size=16,
              num_gpu_blocks_override=24, max_num_snapshots=8)
TWO_LAYERS = dict(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
PROMPTS = [{"prompt_token_ids": list(range(40, 60))}, {"prompt_token_ids": list(range(300, 327))}]
SHORT_PROMPTS = [{"prompt_token_ids": [7, 8, 9, 10, 11, 12, 13]}, {"prompt_token_ids": [400, 3, 250, 17, 90, 6, 31]}]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    """(checkpoint path, the module it was loaded into, an engine started from that module and warmed up)."""
    path = tiny_checkpoint("qwen3_5", seed=3, **TWO_LAYERS)
    model = qflax.from_pretrained(path)
    return path, model, qnext.LLM.from_model(model, warm_up=True, **ENGINE)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def token_logprobs(outputs) -> list[list[float]]:
    return [[entry[t].logprob for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outputs]


def perturbed(model, seed: int = 0, scale: float = 0.3):
    """A copy of the module with every weight moved by scale x its spread (numpy noise: the same in any process)."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    moved = [jnp.asarray(x + scale * (x.std() + 1e-3) * rng.standard_normal(x.shape).astype(x.dtype))
             for x in map(np.asarray, leaves)]
    copy = nnx.clone(model)
    nnx.update(copy, jax.tree.unflatten(treedef, moved))
    return copy


def left_padded(sequences: list[list[int]]):
    width = max(map(len, sequences))
    ids = np.zeros((len(sequences), width), np.int32)
    mask = np.zeros((len(sequences), width), np.int32)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):], mask[row, width - len(seq):] = seq, 1
    return jnp.asarray(ids), jnp.asarray(mask)


@nnx.jit
def sgd_step(model, optimizer, ids, mask):
    """One optax step on the next-token loss of the left-padded sequences."""
    def loss_fn(model):
        logp = jax.nn.log_softmax(model(ids, mask)[:, :-1])
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_from_model_generates_what_the_checkpoint_engine_does(served):
    path, model, llm = served
    ours = tokens(llm.generate(SHORT_PROMPTS, GREEDY))
    assert ours == tokens(qnext.LLM(path, **ENGINE).generate(SHORT_PROMPTS, GREEDY))
    engine_embed = llm.engine.runner.params["embed"]
    assert engine_embed.unsafe_buffer_pointer() != model.embed[...].unsafe_buffer_pointer()   # its own copy


def test_update_weights_serves_the_trained_module_without_compiling(served):
    _, model, llm = served
    before = llm.generate(PROMPTS, WITH_LOGPROBS)                 # compiles the logprobs sampler, fills the cache
    repeat = llm.generate(PROMPTS, WITH_LOGPROBS)
    assert tokens(repeat) == tokens(before) and all(o.num_cached_tokens > 0 for o in repeat)

    trained = nnx.clone(model)
    optimizer = nnx.Optimizer(trained, optax.sgd(1.0), wrt=nnx.Param)
    sgd_step(trained, optimizer, *left_padded([p["prompt_token_ids"] + t for p, t in zip(PROMPTS, tokens(before))]))

    old = llm.engine.runner.params["embed"]
    buffer = old.unsafe_buffer_pointer()
    start = compilations()
    try:
        llm.update_weights(trained)
        in_place = llm.engine.runner.params["embed"].unsafe_buffer_pointer() == buffer
        after = llm.generate(PROMPTS, WITH_LOGPROBS)
        compiled = compilations() - start
    finally:
        llm.update_weights(model)
    assert compiled == 0
    assert in_place and old.is_deleted()                          # written into the donated buffers
    assert [o.num_cached_tokens for o in after] == [0, 0]

    # the module's own log-softmax at the generated positions
    sequences = [p["prompt_token_ids"] + t for p, t in zip(PROMPTS, tokens(after))]
    ids, mask = left_padded(sequences)
    logp = np.asarray(jax.nn.log_softmax(nnx.jit(lambda m, i, k: m(i, k))(trained, ids, mask)))
    width = ids.shape[1]
    for row, (prompt, out, lps) in enumerate(zip(PROMPTS, tokens(after), token_logprobs(after))):
        start = width - len(sequences[row]) + len(prompt["prompt_token_ids"]) - 1   # predicts the first output
        rows = logp[row, start:start + len(out)]
        assert rows.argmax(-1).tolist() == out
        diff = np.abs(rows[np.arange(len(out)), out] - np.array(lps)).max()
        assert diff < 1e-4, diff
    moved = np.abs(np.array(token_logprobs(after)) - np.array(token_logprobs(before))).max()
    assert moved > 0.05, f"the SGD step barely changed the model (max logprob change {moved})"


def test_update_weights_refuses_requests_in_flight_and_wrong_shapes(served):
    _, model, llm = served
    engine = llm.engine
    engine.add_request("in-flight", PROMPTS[0], GREEDY)
    try:
        with pytest.raises(RuntimeError, match="0 running and 1 waiting requests.*finish or abort them first"):
            llm.update_weights(model)
        engine.step()
        with pytest.raises(RuntimeError, match="1 running and 0 waiting requests"):
            llm.update_weights(model)
    finally:
        engine.abort_request("in-flight")
        engine.release("in-flight")
    llm.update_weights(model)                                     # nothing in flight: accepted
    _, params = qflax.engine_params(model)
    with pytest.raises(ValueError, match="the engine's structure and shapes"):
        engine.update_weights(jax.tree.map(lambda x: x[..., :1], params))
    with pytest.raises(TypeError, match="takes a qnext.flax.HybridCausalLM"):
        llm.update_weights(params)


_TWO_DEVICES = textwrap.dedent("""
    import json, sys
    import qnext, qnext.flax as qflax
    from tests.flax.test_flax_engine import ENGINE, GREEDY, SHORT_PROMPTS, perturbed, tokens

    model = qflax.from_pretrained(sys.argv[1])
    llm = qnext.LLM.from_model(model, tensor_parallel_size=2, **ENGINE)
    before = tokens(llm.generate(SHORT_PROMPTS, GREEDY))
    llm.update_weights(perturbed(model))
    print(json.dumps({"before": before, "after": tokens(llm.generate(SHORT_PROMPTS, GREEDY))}))
""")


def test_two_devices_serve_and_update_as_one(served):
    path, model, llm = served
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=str(ROOT))
    two = subprocess.Popen([sys.executable, "-c", _TWO_DEVICES, str(path)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    try:
        before = tokens(llm.generate(SHORT_PROMPTS, GREEDY))
        try:
            llm.update_weights(perturbed(model))
            after = tokens(llm.generate(SHORT_PROMPTS, GREEDY))
        finally:
            llm.update_weights(model)
        stdout, stderr = two.communicate(timeout=600)
    finally:
        two.kill()                                                # no-op once it has exited
    assert two.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert after != before
    assert out == {"before": before, "after": after}
