"""Suffix and n-gram drafting in the engine (speculative_config method "suffix" / "ngram"): greedy and seeded
sampled tokens equal plain decoding's with rows holding 0, 1 and k drafts in one step (each row reads and writes its
own state row), drafts forced right and wrong, a cached second turn, n > 1, logprobs and a structured row beside
drafting rows; real suffix / n-gram drafts on repetitive prompts are accepted; a request whose drafts fail stops
drafting; bad options are refused."""
from __future__ import annotations

import numpy as np
import pytest

from qnext import LLM, SamplingParams
from qnext.sampling_params import StructuredOutputsParams

K = 3
SUFFIX = {"method": "suffix", "num_speculative_tokens": K}
OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=160, block_size=8, max_num_snapshots=64,
               num_gpu_blocks_override=96)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def prompts(n: int, offset: int = 0) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j + offset) % 400 + 3 for j in range(13 + 3 * i)]} for i in range(n)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def plain(checkpoint):
    return LLM(checkpoint, **OPTIONS)


@pytest.fixture(scope="module")
def suffix(checkpoint):
    return LLM(checkpoint, speculative_config=SUFFIX, **OPTIONS)


def force_drafts(llm, choose):
    """The engine's drafter proposes choose(prompt, output, room) instead of its index's drafts; returns a list of
    the draft counts per request of every proposal, to check what steps saw."""
    drafter = llm.engine.runner.drafter
    seen = []

    def draft(request_id, room):
        context = drafter.cache.context(request_id)
        seq = next(s for s in llm.engine.scheduler.running if s.request_id == request_id)
        out = choose(seq.prompt_token_ids, context[len(seq.prompt_token_ids):], room)[:room]
        seen.append(len(out))
        return out

    drafter._draft = draft
    drafter.gate.min_acceptance = 0.0            # forced drafts must not switch themselves off
    return seen


def test_rows_with_zero_one_and_k_drafts_equal_plain(plain, suffix):
    """Per step: the first row never drafts, the second drafts 1 (wrong), the third k right, the fourth k wrong.
    Greedy and seeded sampled tokens equal plain decoding's row by row."""
    batch = prompts(4, offset=20)
    vocab = plain.engine.model_config.vocab_size
    for params in (GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True)):
        want = {p["prompt_token_ids"][0]: t for p, t in zip(batch, tokens(plain.generate(batch, params)))}
        rows = list(want)

        def choose(prompt, output, room):
            future = want[prompt[0]][len(output):]
            row = rows.index(prompt[0])
            return [[], [(future[0] + 1) % vocab], future[:K], [(t + 1) % vocab for t in future[:K]]][row] \
                if future else []

        seen = force_drafts(suffix, choose)
        stats = suffix.engine.stats
        before = stats.num_spec_rows, stats.num_draft_tokens, stats.num_accepted_draft_tokens
        assert tokens(suffix.generate(batch, params)) == list(want.values())
        rows_run = stats.num_spec_rows - before[0]
        assert rows_run >= 4 and {0, 1, K} <= set(seen)
        assert 0 < stats.num_accepted_draft_tokens - before[2] < stats.num_draft_tokens - before[1]


def test_suffix_drafts_from_an_earlier_output_are_kept_and_equal_plain(plain, checkpoint):
    """Real suffix drafts (the index, not forced): the same prompts again draft from the shared index of the first
    run's outputs (an agent's repeated turn) and keep them; tokens equal plain decoding's, the second time from the
    prefix cache."""
    batch = prompts(3, offset=200)
    llm = LLM(checkpoint, speculative_config=SUFFIX, **OPTIONS)
    want = tokens(plain.generate(batch, GREEDY))
    assert tokens(llm.generate(batch, GREEDY)) == want
    stats = llm.engine.stats
    first = stats.num_accepted_draft_tokens
    again = llm.generate(batch, GREEDY)
    assert tokens(again) == want and all(o.num_cached_tokens > 0 for o in again)
    assert stats.num_accepted_draft_tokens - first >= 3 * (GREEDY.max_tokens // 2)   # most of each output drafted


def test_ngram_drafts_equal_plain(plain, checkpoint):
    """n-gram drafts with a one-token match over a long prompt: proposed often, kept or not, tokens unchanged."""
    batch = [{"prompt_token_ids": [(37 * j + 11 * i) % 500 + 3 for j in range(100)]} for i in range(2)]
    llm = LLM(checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 4}, **OPTIONS)
    assert tokens(llm.generate(batch, GREEDY)) == tokens(plain.generate(batch, GREEDY))
    assert llm.engine.stats.num_draft_tokens > 0


def test_n_samples_logprobs_and_a_structured_row_equal_plain(plain, suffix):
    """n = 2 seeded samples with logprobs beside a JSON-schema row: the structured row makes its steps plain, the
    others verify drafts forced right once it ends; tokens equal plain decoding's, logprobs within float noise."""
    batch = prompts(2, offset=90)
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)
    schema = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    params = [sampled, schema]
    want = plain.generate(batch, params)
    plain_tokens = {(p["prompt_token_ids"][0], len(o.outputs)): [c.token_ids for c in o.outputs]
                    for p, o in zip(batch, want)}
    futures = [c.token_ids for o in want for c in o.outputs]

    def choose(prompt, output, room):       # whichever plain output this one follows so far
        for f in futures:
            if f[:len(output)] == output and len(f) > len(output):
                return f[len(output):len(output) + K]
        return []

    force_drafts(suffix, choose)
    got = suffix.generate(batch, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == list(plain_tokens.values())
    for w, g in zip(want[0].outputs, got[0].outputs):
        lw = [d[t].logprob for d, t in zip(w.logprobs, w.token_ids)]
        lg = [d[t].logprob for d, t in zip(g.logprobs, g.token_ids)]
        np.testing.assert_allclose(lg, lw, atol=2e-4)


def test_low_acceptance_turns_drafting_off(checkpoint, plain):
    llm = LLM(checkpoint, speculative_config=SUFFIX, **OPTIONS)
    vocab = llm.engine.model_config.vocab_size
    batch = prompts(1, offset=300)
    want = tokens(plain.generate(batch, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)))
    drafter = llm.engine.runner.drafter
    drafter._draft = lambda rid, room: [(t + 1) % vocab for t in want[0][len(drafter.cache.context(rid)) -
                                                                         len(batch[0]["prompt_token_ids"]):][:room]]
    got = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    assert tokens(got) == want
    stats = llm.engine.stats
    # 8 failed windows, 32 plain steps, 8 failed windows again, then off for 64 steps: 1 + 8 + 32 + 8 < 60 tokens
    assert drafter.gate.num_turned_off == 2
    assert stats.num_spec_rows == 2 * drafter.gate.patience


@pytest.mark.parametrize("spec, message", [
    ({"method": "suffix", "prompt_lookup_min": 2}, "do not apply"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2.0}, "min_token_prob"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
])
def test_bad_options_are_refused(spec, message):
    from qnext.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)
    EngineConfig(speculative_config={"method": "suffix"})              # k defaults to the most
