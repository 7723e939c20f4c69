"""The benchmarks' multi-turn chat: turn k's prompt is the history plus a new message, one request at a time,
prefix caching on and off side by side; and the engine options the offline and chat engines share."""
from __future__ import annotations

import dataclasses
import time

import numpy as np


def engine_options(args, batches: list[int], budget: int, enable_prefix_caching: bool) -> dict:
    """One set of buffer shapes per model (offline and chat engines share every compilation)."""
    chat_len = args.first_message + (args.turns - 1) * (args.message + args.reply) + args.reply
    max_len = max(args.input_len[1] + args.output_len, chat_len) + 1
    max_len = -(-max_len // 16) * 16
    seqs = max(batches + [1])
    return dict(max_num_seqs=seqs, max_num_batched_tokens=max(budget, seqs), max_model_len=max_len, block_size=16,
                dtype=args.dtype, seed=args.seed, max_num_snapshots=2 * seqs,
                num_scheduler_steps=args.num_scheduler_steps, tensor_parallel_size=args.tensor_parallel_size,
                enable_prefix_caching=enable_prefix_caching)


def run_chat(engines: dict, args, vocab: int, rng) -> dict:
    """Chats run one request at a time, turn by turn, alternating cache on / off so load hits both alike. Each turn's
    prompt = the previous prompt + its reply (from the cache-on engine) + a new message."""
    from qnext.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True)

    def one(engine, rid, prompt):
        stats0 = dataclasses.asdict(engine.cache_stats)
        t0 = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        ttft, out = None, None
        while engine.has_unfinished_requests():
            for o in engine.step():
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                if o.finished:
                    out = list(o.outputs[0].token_ids)
        engine.release(rid)
        stats1 = dataclasses.asdict(engine.cache_stats)
        return ttft, out, {k: stats1[k] - stats0[k] for k in ("prompt_tokens", "reused_tokens", "kv_matched_tokens",
                                                              "lost_to_missing_state_tokens")}

    def chat(n_chats, tag, record):
        turns = [dict(turn=k + 1, prompt_len=[], ttft_on_s=[], ttft_off_s=[], reused_tokens=0, kv_matched_tokens=0,
                      lost_to_missing_state_tokens=0, prompt_tokens=0, same_output=0) for k in range(args.turns)]
        for c in range(n_chats):
            prompt = rng.integers(3, vocab - 8, args.first_message).tolist()
            for k in range(args.turns):
                ttft_on, out_on, cache = one(engines[True], f"{tag}-{c}-{k}-on", prompt)
                ttft_off, out_off, _ = one(engines[False], f"{tag}-{c}-{k}-off", prompt)
                t = turns[k]
                t["prompt_len"].append(len(prompt))
                t["ttft_on_s"].append(ttft_on)
                t["ttft_off_s"].append(ttft_off)
                t["same_output"] += out_on == out_off
                for key in ("reused_tokens", "kv_matched_tokens", "lost_to_missing_state_tokens", "prompt_tokens"):
                    t[key] += cache[key]
                prompt = prompt + out_on + rng.integers(3, vocab - 8, args.message).tolist()
        if record:
            for t in turns:
                t["ttft_on_s"], t["ttft_off_s"] = float(np.median(t["ttft_on_s"])), float(np.median(t["ttft_off_s"]))
                t["prompt_len"] = float(np.mean(t["prompt_len"]))
                t["ttft_ratio"] = t["ttft_on_s"] / t["ttft_off_s"]
                t["same_output"] /= n_chats
            return turns
        return None

    chat(1, "chat-warmup", record=False)     # a chat of the same shapes first: compiles, fills both caches alike
    compiled = engines[True].stats.num_compilations   # process-wide: both engines' compilations count
    turns = chat(args.chats, "chat", record=True)
    return {"turns": turns, "chats": args.chats,
            "compilations_while_timed": engines[True].stats.num_compilations - compiled,
            "cache_stats_on": engines[True].cache_stats.as_dict()}
