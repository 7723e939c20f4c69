"""Prefill/decode disaggregation between engines in one process (qnext/engine/pd_transfer.py, docs/pd.md):
greedy outputs equal one instance's, token for token (and each token's logprob within 1e-4), over 100+ short
prompts (a few tokens to 3 blocks, some sharing prefixes) across TP1 -> TP2 and TP2 -> TP1, with and without the
decode side's own cached prefix, with MTP on the decode side (TP2 -> TP1 + MTP) and on the prefill side (its head's
KV layer exported, dropped by a decode side without one), requests arriving while others decode; Qwen3-Next between
TP1 and TP4 (heads replicated); only the missing blocks and one state move.

The engines run in a subprocess with two (four) XLA host devices (the flag must be set before JAX starts)."""
from __future__ import annotations

import textwrap
import time

import numpy as np
import pytest

from qnext.model.canonical_layout import conv_from_canonical, conv_to_canonical, kv_from_canonical, kv_to_canonical
from tests.support.host_device_script import run_on_host_devices

_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    from qnext import SamplingParams
    from qnext.config import ModelConfig
    from qnext.engine.llm_engine import LLMEngine
    from qnext.engine.sequence_features import computed_elsewhere
    from qnext.model.loader import load_params
    from qnext.model.mtp import init_mtp_params, save_mtp_params
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    family, num_prompts, chosen_sets = sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    path = write_tiny_checkpoint(sys.argv[1] + "/" + family, family, seed=3)
    cfg = ModelConfig.from_pretrained(path)
    save_mtp_params(path, init_mtp_params(load_params(path, cfg), cfg, jax.random.key(1)), cfg)
    # steps of at most 16 tokens: one prefill shape (and its mixed twin) per engine, as compiling dominates here;
    # longer prompts prefill over several steps
    options = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, block_size=16,
                   num_gpu_blocks_override=128, max_num_snapshots=32)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

    rng = np.random.default_rng(0)
    stems = [rng.integers(3, 500, n).tolist() for n in (16, 20, 32)]    # shared prefixes, on and off a boundary
    prompts = []
    for i in range(num_prompts):
        tail = rng.integers(3, 500, int(rng.integers(1, 17))).tolist()
        prompts.append(stems[i % 3] + tail if i % 2 else rng.integers(3, 500, int(rng.integers(2, 49))).tolist())

    def tokens_and_logprobs(out):   # (token ids, each one's logprob): a state moved wrong shows in the logprobs first
        o = out.outputs[0]
        return list(o.token_ids), [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)]

    def drain(engine, outs):
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        return outs

    def single(engine, ids):
        for i in ids:
            engine.add_request(f"ref{i}", {"prompt_token_ids": prompts[i]}, greedy)
        outs = {}
        while engine.has_unfinished_requests():
            drain(engine, outs)
        return {i: tokens_and_logprobs(outs[f"ref{i}"]) for i in ids}

    def disaggregated(prefill, decode, ids, tag):
        # three new prompts reach the prefill engine per round; finished prefills move while the decode engine decodes
        pending, first, outs, moves = list(ids), {}, {}, []
        while pending or prefill.has_unfinished_requests() or decode.has_unfinished_requests():
            for i in pending[:3]:
                prefill.pd.add_prefill_request(f"{tag}{i}", {"prompt_token_ids": prompts[i]}, greedy)
            pending = pending[3:]
            for o in prefill.step():
                assert o.finished and o.outputs[0].finish_reason == "prefilled", o.outputs[0].finish_reason
                bundle = prefill.pd.take_prefill_bundle(o.request_id)
                first[o.request_id] = list(o.outputs[0].token_ids)
                running = decode.num_running
                decode.pd.add_transferred_request(o.request_id, {"prompt_token_ids": bundle.meta["prompt_token_ids"]},
                                                  greedy, bundle)
                t = computed_elsewhere(decode.scheduler.waiting[-1]).transferred
                moves.append([t.num_held_blocks, len(prompts[int(o.request_id.split(":")[1])]), t.bytes_moved,
                              t.min_bytes, running])
            if decode.has_unfinished_requests():
                drain(decode, outs)
        got = {i: tokens_and_logprobs(outs[f"{tag}{i}"]) for i in ids}
        assert all(first[f"{tag}{i}"] == got[i][0][:1] for i in ids)
        return got, moves

    engines = {"tp1": LLMEngine(path, **options)}
    for name in {side for pair in chosen_sets for side in pair.split("->")} - {"tp1"}:
        if name == "tp1+mtp":
            engines[name] = LLMEngine(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                                      **options)
        else:                     # a TP engine (TP2 runs 4-step windows)
            tp = int(name[2:])
            engines[name] = LLMEngine(path, tensor_parallel_size=tp, num_scheduler_steps=4 if tp == 2 else 1,
                                      **options)
    ids = list(range(num_prompts))
    want = single(engines["tp1"], ids)      # tp1's cache now holds every prompt
    out = {}
    for k, name in enumerate(chosen_sets):  # tp2 and tp1+mtp start with empty caches
        prefill, decode = name.split("->")
        chosen = ids[k * num_prompts // len(chosen_sets):(k + 1) * num_prompts // len(chosen_sets)]
        got, moves = disaggregated(engines[prefill], engines[decode], chosen, name + ":")
        out[name] = {"equal": all(got[i][0] == want[i][0] for i in chosen), "moves": moves, "n": len(chosen),
                     "logprob_diff": max(float(np.abs(np.subtract(got[i][1], want[i][1])).max()) for i in chosen)}
    out["spec_rows"] = engines["tp1+mtp"].stats.num_spec_rows if "tp1+mtp" in engines else 0
    print(json.dumps(out))
""")


def _check(out: dict, names: list[str]) -> None:
    for name in names:
        case = out[name]
        assert case["equal"], name
        assert case["logprob_diff"] < 1e-4, (name, case["logprob_diff"])   # TP sums in another order: ~1e-6
        moves = np.array(case["moves"])
        assert len(moves) == case["n"]
        assert (moves[:, 2] == moves[:, 3]).all(), name            # bytes moved = missing blocks + one state
        assert (moves[:, 4] > 0).any(), name                       # some arrived while others decoded


def test_disaggregated_greedy_equals_one_instance(tmp_path):
    # tp1 (the single instance first) prefills for tp2, whose cache starts empty; tp2 prefills for tp1 + MTP; the
    # MTP engine prefills (its head's KV layer exported) for tp2, which drops that layer; tp2 prefills for tp1,
    # whose cache holds every prompt's full blocks
    names = ["tp1->tp2", "tp2->tp1+mtp", "tp1+mtp->tp2", "tp2->tp1"]
    out = run_on_host_devices(_SCRIPT, 2, str(tmp_path), "qwen3_5", "104", ",".join(names), timeout=900)
    _check(out, names)
    first = np.array(out["tp1->tp2"]["moves"])
    assert (first[:, 0] == 0).any() and (first[:, 0] > 0).any()     # without, and later with, a cached prefix
    held = np.array(out["tp2->tp1"]["moves"])                       # tp1 ran every prompt: it holds all full blocks
    np.testing.assert_array_equal(held[:, 0], held[:, 1] // 16)
    assert out["spec_rows"] > 0                                     # the MTP decode side speculated


def test_disaggregated_qwen3_next_with_replicated_heads(tmp_path):
    # at TP4 both KV heads and both DeltaNet key heads are held twice: the canonical layout drops and repeats them
    out = run_on_host_devices(_SCRIPT, 4, str(tmp_path), "qwen3_next", "8", "tp1->tp4,tp4->tp1", timeout=900)
    _check(out, ["tp1->tp4", "tp4->tp1"])


def test_canonical_layout_undoes_device_major_conv_channels_and_replicated_heads(tiny_checkpoint):
    from qnext.config import ModelConfig

    cfg = ModelConfig.from_pretrained(tiny_checkpoint("qwen3_5"))   # KV heads 2, DeltaNet key heads 2, value heads 4
    rng = np.random.default_rng(0)
    conv = rng.standard_normal((3, cfg.conv_dim)).astype(np.float32)
    q, k, v = np.split(conv, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for tp in (1, 2, 4):
        laid = conv_from_canonical(conv, cfg, tp)
        per_device = np.split(laid, tp, axis=-1)
        for r in range(tp):   # device r: its value heads, and the key head(s) they read, as q | k | v
            hv = cfg.linear_num_value_heads // tp
            keys = sorted({h * cfg.linear_num_key_heads // cfg.linear_num_value_heads for h in range(r * hv, (r + 1) * hv)})
            want = np.concatenate([q[:, [c for h in keys for c in range(h * dk, (h + 1) * dk)]],
                                   k[:, [c for h in keys for c in range(h * dk, (h + 1) * dk)]],
                                   v[:, r * hv * dv:(r + 1) * hv * dv]], axis=-1)
            np.testing.assert_array_equal(per_device[r], want)
        np.testing.assert_array_equal(conv_to_canonical(laid, cfg, tp), conv)
    pages = rng.standard_normal((cfg.num_key_value_heads, 3, 16, cfg.head_dim)).astype(np.float32)
    wide = kv_from_canonical(pages, cfg, 4)                    # 2 KV heads over 4 devices: each twice, in place
    np.testing.assert_array_equal(wide, pages[[0, 0, 1, 1]])
    np.testing.assert_array_equal(kv_to_canonical(wide, cfg, 4), pages)
    np.testing.assert_array_equal(kv_from_canonical(pages, cfg, 2), pages)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    from qnext.engine.llm_engine import LLMEngine

    return LLMEngine(tiny_checkpoint("qwen3_5"), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                     block_size=16, num_gpu_blocks_override=32)


GREEDY = dict(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(3, 40))}


def _prefilled(engine, request_id: str, params=None):
    from qnext import SamplingParams

    engine.pd.add_prefill_request(request_id, PROMPT, params or SamplingParams(**GREEDY))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs, engine.pd.take_prefill_bundle(request_id)


def test_refusals_say_why_and_an_aborted_transfer_releases_its_blocks(engine):
    import dataclasses

    from qnext import SamplingParams

    greedy = SamplingParams(**GREEDY)
    with pytest.raises(ValueError, match="n=1"):
        engine.pd.add_prefill_request("two", PROMPT, SamplingParams(n=2, max_tokens=3))
    _, bundle = _prefilled(engine, "a")
    assert engine.pd.take_prefill_bundle("a") is None                     # taken once
    with pytest.raises(ValueError, match="is not this request's"):
        engine.pd.add_transferred_request("b", {"prompt_token_ids": list(range(4, 41))}, greedy, bundle)
    other = dataclasses.replace(bundle, meta={**bundle.meta, "layout": {**bundle.meta["layout"], "block_size": 8}})
    with pytest.raises(ValueError, match="block_size=8"):
        engine.pd.add_transferred_request("b", PROMPT, greedy, other)
    free = engine.cache.manager.num_free_blocks
    engine.pd.add_transferred_request("b", PROMPT, greedy, bundle)        # holds its 2 cached full blocks
    assert engine.cache.manager.num_free_blocks == free - 2
    engine.abort_request("b")
    assert engine.cache.manager.num_free_blocks == free


class _Source:
    """A prefill side that tells the truth, or lies as told: its metadata, or arrays other than announced."""

    def __init__(self, bundle, meta=None, short: str | None = None):
        self.bundle, self.meta, self.short, self.fetched = bundle, meta or bundle.meta, short, []

    def fetch(self, first_block, num_kv_layers):
        self.fetched.append(first_block)
        arrays = self.bundle.fetch(first_block, num_kv_layers)
        if self.short is not None:
            arrays[self.short] = arrays[self.short][:-1]
        return arrays


def test_a_lying_or_unfit_prefill_side_is_refused_before_its_arrays_touch_the_cache(engine):
    from qnext import SamplingParams
    from qnext.engine.pd_transfer import PeerMismatchError

    greedy = SamplingParams(**GREEDY)
    _, bundle = _prefilled(engine, "c")
    free = engine.cache.manager.num_free_blocks
    # another model (a fine-tune of the same base: same shapes, other weights)
    liar = _Source(bundle, {**bundle.meta, "model_identity": "0" * 32})
    with pytest.raises(PeerMismatchError, match="computes another model"):
        engine.pd.add_transferred_request("d", PROMPT, greedy, liar)
    # a bundle claiming a million blocks (the decode side would pull whatever size it was told)
    with pytest.raises(PeerMismatchError, match="1000000 blocks for 3"):
        engine.pd.add_transferred_request("d", PROMPT, greedy, _Source(bundle, {**bundle.meta, "num_blocks": 10**6}))
    # a first token that ends the request here (max_tokens 1 on the decode side only): the client's error, seen
    # before anything is held or fetched
    ends = _Source(bundle)
    with pytest.raises(ValueError, match="the first token ends this request here"):
        engine.pd.add_transferred_request("d", PROMPT, SamplingParams(temperature=0, max_tokens=1), ends)
    assert ends.fetched == [] and liar.fetched == []
    # arrays shorter than the metadata announced (a state row cut short)
    for name in ("conv.0", "recurrent.0"):
        with pytest.raises(PeerMismatchError, match=f"sent {name} as"):
            engine.pd.add_transferred_request("d", PROMPT, greedy, _Source(bundle, short=name))
    assert engine.cache.manager.num_free_blocks == free and not engine.has_unfinished_requests()
    engine.pd.add_transferred_request("d", PROMPT, greedy, _Source(bundle))         # the truth still goes through
    while engine.has_unfinished_requests():
        engine.step()


def test_prefill_bundles_are_bounded_and_none_is_made_for_a_request_the_first_token_ends(engine):
    from qnext import SamplingParams
    from qnext.engine.pd_transfer import bundle_nbytes

    outputs, bundle = _prefilled(engine, "one-token", SamplingParams(temperature=0, max_tokens=1))
    assert outputs[-1].outputs[0].finish_reason == "length" and bundle is None
    _, first = _prefilled(engine, "e")
    engine.pd.exports.limit(ttl_s=60, max_bytes=bundle_nbytes(first.arrays) + 1)   # room for one bundle
    try:
        for rid in ("f", "g"):
            engine.pd.add_prefill_request(rid, PROMPT, SamplingParams(**GREEDY))
            while engine.has_unfinished_requests():
                engine.step()
        assert engine.pd.take_prefill_bundle("f") is None and engine.pd.take_prefill_bundle("g") is not None
        engine.pd.exports.limit(ttl_s=1e-3, max_bytes=1 << 30)
        _prefilled(engine, "h")
        time.sleep(0.01)
        assert engine.pd.take_prefill_bundle("h") is None                 # expired
    finally:
        engine.pd.exports.limit(ttl_s=120, max_bytes=1 << 30)
