"""MTP speculative decoding in the engine (speculative_config): greedy tokens equal plain decoding's on the three
families (batch 1 and 8 on Qwen3.5, 4 on the others), with the prefix cache on (a second turn served from it), under preemption and with the
host tier; drafts forced all accepted and all rejected give plain decoding's tokens too; sampled rows run; the
server over an MTP engine answers the openai SDK with plain decoding's text; and the options that cannot combine
with it are refused."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from qnext import LLM, SamplingParams
from qnext.bench.oracle_drafts import oracle_drafter
from qnext.config import ModelConfig
from qnext.model.loader import load_params
from qnext.model.mtp import init_mtp_params, save_mtp_params
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

K = 2
SPEC = {"method": "mtp", "num_speculative_tokens": K}
# max_num_snapshots: rows enough that two turns of 8 rows evict no snapshot (prompt captures, tracking rows,
# sequence ends), so cache hits of a plain and an MTP engine compare what their steps left cached, not how two pool
# sizes' LRUs fared: by default the MTP engine's pool is smaller (its blocks hold the head's KV layer too, and
# cache_setup.cache_sizes bounds the rows by the KV they can anchor). Every engine here has the same pool, so the
# plain and the speculative engines each compile once (compilation is most of this module's time). The same KV
# blocks too (96: the preemption test's long outputs outgrow them, every other test's sequences fit), and one
# prefill shape of 16 tokens (and its mixed twin) rather than four.
OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=160, block_size=8, max_num_snapshots=64,
               num_gpu_blocks_override=96)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(n: int, offset: int = 0) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j + offset) % 400 + 3 for j in range(13 + 3 * i)]} for i in range(n)]


def with_mtp_head(tmp_path_factory, family: str):
    """A tiny checkpoint with an MTP head (initialised from the decoder's last full-attention layer)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(f"mtp-{family}"), family)
    cfg = ModelConfig.from_pretrained(path)
    save_mtp_params(path, init_mtp_params(load_params(path, cfg), cfg, jax.random.key(1)), cfg)
    return path


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def second_turn(first, outputs) -> list[dict]:
    """Each conversation continued: its prompt, its answer and a few new tokens."""
    return [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids + [11, 12, 13]}
            for p, o in zip(first, outputs)]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_greedy_equals_plain_with_a_cached_second_turn(family, tmp_path_factory, request):
    if family == "qwen3_5":                      # the module's checkpoint and plain engine
        path, plain = request.getfixturevalue("checkpoint"), request.getfixturevalue("plain")
    else:
        path = with_mtp_head(tmp_path_factory, family)
        plain = LLM(path, **OPTIONS)
    spec = LLM(path, speculative_config=SPEC, **OPTIONS)
    # batch 1 and 8 on Qwen3.5; one batch of 4 on the other families (each batch shape compiles anew)
    batches = (prompts(1), prompts(8, offset=50)) if family == "qwen3_5" else (prompts(4, offset=50),)
    for batch in batches:
        want, got = plain.generate(batch, GREEDY), spec.generate(batch, GREEDY)
        assert tokens(got) == tokens(want)
        turn = second_turn(batch, got)
        want2, got2 = plain.generate(turn, GREEDY), spec.generate(turn, GREEDY)
        assert tokens(got2) == tokens(want2)
        assert all(o.num_cached_tokens > 0 for o in got2)       # the second turn came from the prefix cache
    stats = spec.engine.stats
    assert stats.num_spec_rows > 0 and stats.num_draft_tokens > 0  # speculative steps ran
    # every generated token came from the target: the verify passes emitted 1 + accepted tokens each
    assert 1.0 <= stats.acceptance_length <= K + 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return with_mtp_head(tmp_path_factory, "qwen3_5")


@pytest.fixture(scope="module")
def plain(checkpoint):
    return LLM(checkpoint, **OPTIONS)


@pytest.mark.parametrize("forced", ["accept", "reject"])
def test_forced_acceptance_and_rejection_equal_plain_decoding(checkpoint, plain, forced):
    batch = prompts(4, offset=100)
    want = {p["prompt_token_ids"][0]: t for p, t in zip(batch, tokens(plain.generate(batch, GREEDY)))}
    vocab = plain.engine.model_config.vocab_size

    def oracle(prompt, output):      # the plain run's next k tokens, or a token that is never them
        future = want[prompt[0]][len(output):][:K]
        future += [0] * (K - len(future))
        return future if forced == "accept" else [(t + 1) % vocab for t in future]

    spec = LLM(checkpoint, speculative_config=SPEC, drafter=oracle_drafter(oracle), **OPTIONS)
    assert tokens(spec.generate(batch, GREEDY)) == list(want.values())
    # drafts chosen on the host: the head never ran, so its KV layer (the cache's last) holds nothing
    buffers = spec.engine.cache.lend_buffers()
    assert not np.any(np.asarray(buffers.kv[-1][0])) and np.any(np.asarray(buffers.kv[0][0]))
    spec.engine.cache.return_buffers(buffers)
    stats = spec.engine.stats
    if forced == "accept":           # whole windows kept, but where max_tokens cuts the last one
        assert stats.num_accepted_draft_tokens >= 0.9 * stats.num_draft_tokens > 0
    else:
        assert stats.num_accepted_draft_tokens == 0 and stats.num_draft_tokens > 0
        assert stats.acceptance_length == 1.0


def test_rows_with_penalties_speculate_and_equal_plain_decoding(checkpoint, plain):
    """Rows with penalties speculate, and their tokens equal plain decoding's with the head's drafts, drafts forced
    all accepted (every window position's token is used) and drafts forced all rejected. The per-position counts
    themselves (the drafts before each position) are pinned by test_spec_decode's penalties test: on this random
    tiny model a just-drafted token is rarely the one a position would otherwise pick."""
    batch = prompts(3, offset=150)
    penalised = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=2.0,
                               frequency_penalty=2.0, repetition_penalty=1.5)
    want = {p["prompt_token_ids"][0]: t for p, t in zip(batch, tokens(plain.generate(batch, penalised)))}
    assert list(want.values()) != tokens(plain.generate(batch, GREEDY))      # the penalties change the output
    vocab = plain.engine.model_config.vocab_size
    for forced in ("head", "accept", "reject"):
        def oracle(prompt, output):
            future = want[prompt[0]][len(output):][:K]
            future += [0] * (K - len(future))
            return future if forced == "accept" else [(t + 1) % vocab for t in future]

        drafter = {} if forced == "head" else {"drafter": oracle_drafter(oracle)}
        spec = LLM(checkpoint, speculative_config=SPEC, **drafter, **OPTIONS)
        stats = spec.engine.stats
        assert tokens(spec.generate(batch, penalised)) == list(want.values()), forced
        assert stats.num_spec_rows > 0, forced                               # the rows did speculate
        if forced == "accept":
            assert stats.num_accepted_draft_tokens >= 0.9 * stats.num_draft_tokens
        if forced == "reject":
            assert stats.num_accepted_draft_tokens == 0


def stop_string_in(text: str, i: int) -> str:
    """Two letters of `text` from about a third of the way on (i varies where): a stop string the plain run meets
    mid-output."""
    start = len(text) // 3 + i % 5
    return next(text[j:j + 2] for j in range(start, len(text) - 1) if text[j:j + 2].isalpha())


def finished(outputs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in (o.outputs[0] for o in outputs)]


def assert_logprobs_close(got, want):
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        for entry, expected in zip(g or [], w or []):
            assert entry.keys() == expected.keys()
            for t, lp in entry.items():
                assert lp.rank == expected[t].rank and lp.decoded_token == expected[t].decoded_token
                assert abs(lp.logprob - expected[t].logprob) < 1e-4


def test_rows_with_stop_strings_and_logprobs_speculate_and_equal_plain_decoding(checkpoint, plain):
    """Stop strings: the host appends a window's tokens one at a time and drops those after the stop, so tokens,
    text, finish and stop reasons equal plain decoding's, with drafts forced all accepted (whole windows run past
    the stop) and with the head's; a later turn is served from the cache as much as after plain decoding (no
    tracking snapshot lost to a state past the stop) and equals it. Logprobs: every emitted token's, from the
    verify pass, equal plain decoding's (ids and ranks exactly, values within float32 noise).
    Both engines' snapshot pools have OPTIONS' rows and nothing may be evicted: with the default sizing the head's KV
    layer leaves the speculative engine fewer snapshot rows than the plain one (12 against 14), and which prompt
    snapshots the LRU then drops depends on the outputs, not on what the windows left behind."""
    batch = prompts(8, offset=300)
    texts = [o.outputs[0].text for o in plain.generate(batch, GREEDY)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop_string_in(t, i)],
                             logprobs=2 if i % 2 else None) for i, t in enumerate(texts)]
    vocab = plain.engine.model_config.vocab_size
    for forced in ("accept", "head"):
        reference = LLM(checkpoint, **OPTIONS)                 # fresh caches on both sides: the same history
        want = reference.generate(batch, params)
        assert sum(c.finish_reason == "stop" for c in (o.outputs[0] for o in want)) >= 6
        future = {p["prompt_token_ids"][0]: o.outputs[0].token_ids for p, o in zip(batch, want)}
        drafter = {} if forced == "head" else {      # the plain run's tokens, then tokens past its stop
            "drafter": oracle_drafter(lambda prompt, output: (future[prompt[0]][len(output):]
                                                              + [((len(prompt) + len(output)) * 7) % vocab] * K)[:K])}
        spec = LLM(checkpoint, speculative_config=SPEC, **drafter, **OPTIONS)
        dropped, postprocess = [], spec.engine.scheduler.postprocess

        def counting(plan, result):                       # tokens a speculative step ran that the host dropped
            before = [len(it.seq.output_token_ids) for it in plan.items]
            out = postprocess(plan, result)
            if plan.speculative:
                dropped.extend(int(result.ran[i]) - (len(it.seq.output_token_ids) - b)
                               for i, (it, b) in enumerate(zip(plan.items, before)))
            return out

        spec.engine.scheduler.postprocess = counting
        got = spec.generate(batch, params)
        assert finished(got) == finished(want), forced
        assert_logprobs_close([o.outputs[0].logprobs for o in got], [o.outputs[0].logprobs for o in want])
        assert spec.engine.stats.num_spec_rows > 0
        if forced == "accept":
            assert sum(dropped) > 0                       # windows did run past a stop string
        turn = second_turn(batch, got)
        want2, got2 = reference.generate(turn, GREEDY), spec.generate(turn, GREEDY)
        assert tokens(got2) == tokens(want2), forced
        assert [o.num_cached_tokens for o in got2] == [o.num_cached_tokens for o in want2], forced
        assert [llm.engine.cache_stats.snapshots_evicted for llm in (reference, spec)] == [0, 0], forced


def recorded_drafts(llm) -> list[dict]:
    """Every step's drafts ({request_id: drafts}), recorded from the engine's runner as the run goes."""
    steps, execute = [], llm.engine.runner.execute

    def record(plan):
        result = execute(plan)
        steps.append(dict(result.drafts or {}))
        return result

    llm.engine.runner.execute = record
    return steps


def test_a_draft_token_map_restricts_drafts_and_keeps_plain_tokens(checkpoint, plain, tmp_path):
    batch = prompts(3, offset=50)
    want = tokens(plain.generate(batch, GREEDY))
    options = dict(OPTIONS, enable_prefix_caching=False)
    vocab = plain.engine.model_config.vocab_size
    np.save(tmp_path / "permuted.npy", np.random.default_rng(0).permutation(vocab))
    np.save(tmp_path / "one.npy", np.array([vocab - 1]))
    runs = {}
    for name in ("none", "permuted", "one"):
        config = SPEC if name == "none" else {**SPEC, "speculative_token_map": str(tmp_path / f"{name}.npy")}
        llm = LLM(checkpoint, speculative_config=config, **options)
        drafts = recorded_drafts(llm)
        assert tokens(llm.generate(batch, GREEDY)) == want
        runs[name] = ([[d[rid] for rid in sorted(d)] for d in drafts], llm.engine.stats)
    assert runs["permuted"][0] == runs["none"][0]            # the whole vocabulary, reordered: the same drafts
    drafted = [t for step in runs["one"][0] for row in step for t in row]
    assert drafted and set(drafted) == {vocab - 1}            # a one-id map drafts that id only
    assert runs["one"][1].num_draft_tokens > 0 and runs["one"][1].num_spec_rows > 0


def test_greedy_equals_plain_under_preemption_and_with_the_host_tier(checkpoint, plain):
    batch = prompts(8, offset=200)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    # the reference in halves, which the blocks hold: plain decoding without preemption
    preemptions = plain.engine.scheduler.num_preemptions
    want = tokens(plain.generate(batch[:4], long)) + tokens(plain.generate(batch[4:], long))
    assert plain.engine.scheduler.num_preemptions == preemptions
    # OPTIONS' 96 blocks of 8 tokens cannot hold 8 sequences of ~125 tokens: the newest are preempted and recomputed
    tight = LLM(checkpoint, speculative_config=SPEC, kv_offloading_size=0.001, **OPTIONS)
    assert tokens(tight.generate(batch, long)) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.stats.num_spec_rows > 0
    # the evicted prefixes went to the host tier; a second turn loads them back
    turn = second_turn(batch[:2], tight.generate(batch[:2], long))
    got = tight.generate(turn, GREEDY)
    assert tokens(got) == tokens(plain.generate(turn, GREEDY))
    tiers = tight.engine.cache_stats.tiers
    assert tiers.blocks_offloaded > 0 and tiers.host_hit_tokens > 0


def test_sampled_rows_speculate_and_are_reproducible_by_seed(checkpoint):
    # Which steps verify drafts depends on the schedule (a prefix hit changes it), and a rejected draft's
    # replacement is drawn differently from a plain step's token (the distribution is the same: test_spec_decode),
    # so the same seed gives the same tokens for the same schedule: here, without the prefix cache.
    spec = LLM(checkpoint, speculative_config=SPEC, enable_prefix_caching=False, **OPTIONS)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=5, ignore_eos=True)
    first = tokens(spec.generate(prompts(3), params))
    again = tokens(spec.generate(prompts(3), params))
    assert first == again and all(len(t) == 16 for t in first)
    assert spec.engine.stats.num_spec_rows > 0


def test_disable_by_batch_size_decodes_larger_steps_plainly(checkpoint, plain):
    import jax.numpy as jnp
    import numpy as np

    from qnext.engine.spec_step import ChainInputs

    spec = LLM(checkpoint, speculative_config={**SPEC, "disable_by_batch_size": 2}, **OPTIONS)
    scheduler, runner, steps = spec.engine.scheduler, spec.engine.runner, []   # (rows, speculative) per step
    drafter = runner.drafter
    schedule, kv_only = scheduler.schedule, drafter._kv_catch_up

    def recorded():
        plan = schedule()
        if plan is not None:
            steps.append((len(plan.items), plan.speculative))
        return plan

    def checked_kv_only(params, mtp, buffers, inputs, next_ids, hidden):
        """The head's KV written without drafting equals what the drafting catch-up writes (block 0: dummy)."""
        m, max_blocks = inputs.logits_index.shape[0], inputs.decode.block_table.shape[1]
        chain = ChainInputs(block_table=np.zeros((m, max_blocks), np.int32), running=np.zeros(m, bool))
        _, full = drafter._catch_up(params, mtp, jax.tree.map(jnp.copy, buffers), inputs, next_ids, hidden, chain)
        out = kv_only(params, mtp, buffers, inputs, next_ids, hidden)
        for got, want in zip(out.kv[-1], full.kv[-1]):
            np.testing.assert_array_equal(np.asarray(got)[:, 1:], np.asarray(want)[:, 1:])
        checked_kv_only.calls += 1
        return out

    checked_kv_only.calls = 0
    scheduler.schedule, drafter._kv_catch_up = recorded, checked_kv_only
    batch = prompts(4, offset=300)
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)    # two rows end early: the batch shrinks
    want = tokens(plain.generate(batch[:2], short)) + tokens(plain.generate(batch[2:], GREEDY))
    outs = spec.generate(batch, [short, short, GREEDY, GREEDY])
    assert tokens(outs) == want
    assert checked_kv_only.calls > 0                      # 4-row steps wrote the head's KV without drafting
    assert any(rows > 2 for rows, _ in steps)
    assert not any(rows > 2 and speculative for rows, speculative in steps)
    assert any(speculative for _, speculative in steps)   # the two rows left speculate on that KV
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        LLM(checkpoint, speculative_config={**SPEC, "disable_by_batch_size": 0}, **OPTIONS)


def test_server_with_mtp_answers_the_openai_sdk_as_plain_decoding(checkpoint, plain):
    import time

    import httpx
    import openai

    from qnext.server.app import build_app
    from qnext.testing.inprocess_server import serve_in_thread

    texts = ["The keeper of the lighthouse", "Ships at sea in a storm"]
    want = [o.outputs[0].text for o in plain.generate(texts, GREEDY)]
    spec = LLM(checkpoint, speculative_config=SPEC, **OPTIONS)
    greedy = dict(model="m", temperature=0.0, max_tokens=GREEDY.max_tokens, extra_body={"ignore_eos": True})
    with serve_in_thread(build_app(spec.engine, model_name="m")) as base_url, \
            openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120, max_retries=0) as client:
        assert [client.completions.create(prompt=t, **greedy).choices[0].text for t in texts] == want
        chunks = client.completions.create(prompt=texts[1], stream=True, **greedy)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want[1]
        sampled = client.completions.create(prompt=texts[0], model="m", n=2, seed=3, temperature=0.9,
                                            max_tokens=8, extra_body={"ignore_eos": True})
        assert sorted(c.index for c in sampled.choices) == [0, 1] and sampled.usage.completion_tokens == 16
        stats = spec.engine.stats
        want_lines = [f'qnext:spec_decode_num_{name}_total{{model_name="m"}} {float(value)}'
                      for name, value in (("drafts", stats.num_spec_rows), ("draft_tokens", stats.num_draft_tokens),
                                          ("accepted_tokens", stats.num_accepted_draft_tokens))]
        for _ in range(100):     # the engine thread publishes its counters after delivering a step's tokens
            metrics = httpx.get(base_url + "/metrics", timeout=30).text
            if all(line in metrics for line in want_lines):
                break
            time.sleep(0.1)
        assert all(line in metrics for line in want_lines), metrics
    assert stats.num_spec_rows > 0 and stats.num_draft_tokens > 0


def test_refused_combinations_say_why(checkpoint, tiny_checkpoint):
    with pytest.raises(ValueError, match="has none"):
        LLM(tiny_checkpoint("qwen3_5"), speculative_config=SPEC, **OPTIONS)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(checkpoint, speculative_config=SPEC, num_scheduler_steps=4, **OPTIONS)
    with pytest.raises(ValueError, match="one device"):
        LLM(checkpoint, speculative_config=SPEC, tensor_parallel_size=2, **OPTIONS)
    with pytest.raises(ValueError, match="method"):
        LLM(checkpoint, speculative_config={"method": "eagle", "num_speculative_tokens": 2}, **OPTIONS)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(checkpoint, speculative_config={"method": "mtp", "num_speculative_tokens": 0}, **OPTIONS)
    with pytest.raises(ValueError, match="block"):
        LLM(checkpoint, speculative_config={"method": "mtp", "num_speculative_tokens": 7},
            **{**OPTIONS, "block_size": 4})
    with pytest.raises(ValueError, match="speculative_token_map .* is not a file"):
        LLM(checkpoint, speculative_config={**SPEC, "speculative_token_map": "/nonexistent/map.npy"}, **OPTIONS)


def test_serve_flag_takes_vllms_json():
    from qnext.server.cli import build_parser

    parser, names = build_parser()
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}'])
    assert "speculative_config" in names
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):                       # argparse reports the JSON error and exits
        parser.parse_args(["serve", "--speculative-config", "{method: mtp}"])


def test_speculative_steps_capture_and_restore_through_a_bf16_snapshot_pool(checkpoint):
    """mamba_ssm_cache_dtype bfloat16: the verify step restores from the narrow device pool and commit_positions
    writes its block-boundary captures into it; the tokens equal plain decoding's with the same pool, and the second
    turn comes from it."""
    plain = LLM(checkpoint, mamba_ssm_cache_dtype="bfloat16", **OPTIONS)
    spec = LLM(checkpoint, speculative_config=SPEC, mamba_ssm_cache_dtype="bfloat16", **OPTIONS)
    assert spec.engine.scheduler.cache.buffers.snapshot_recurrent[0].dtype.name == "bfloat16"
    batch = prompts(4, offset=50)
    got = spec.generate(batch, GREEDY)
    assert tokens(got) == tokens(plain.generate(batch, GREEDY))
    turn = second_turn(batch, got)
    got2 = spec.generate(turn, GREEDY)
    assert tokens(got2) == tokens(plain.generate(turn, GREEDY))
    assert all(o.num_cached_tokens > 0 for o in got2)
    assert spec.engine.cache_stats.snapshots_restored > 0 and spec.engine.stats.num_spec_rows > 0
