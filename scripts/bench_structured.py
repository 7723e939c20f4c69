"""Structured outputs: what a JSON-schema constraint costs, side by side in one run.

- engine: decode tokens/s of the `small` preset (qnext/bench/presets.py) at batch 1 and 16, every row sampling at
  temperature 1, with no constraint and with a JSON schema (ORDER_SCHEMA's orders in an array, so no row completes
  before the output length); passes alternate and each mode's fastest pass counts. Also the host's mask time per
  constrained row and token (llguidance, computed while the device runs the step) and the first compile of the
  schema.
- libraries: llguidance (the engine's), xgrammar and outlines-core (when importable; `--lib-path` adds a folder to
  sys.path) on ORDER_SCHEMA: compile time and mask time per token along a valid document, at the tiny tokenizer's
  vocabulary (512) and at a synthetic byte-level vocabulary of Qwen3.5's size (248,320;
  qnext/bench/synthetic_tokenizer.py).

    python scripts/bench_structured.py --json-out docs/bench/structured-cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qnext.bench.grammar_libraries import ORDER_SCHEMA, compare  # noqa: E402
from qnext.bench.presets import PRESETS, bench_checkpoint  # noqa: E402

ENGINE_SCHEMA = {"type": "object", "properties": {"orders": {"type": "array", "minItems": 100, "items": ORDER_SCHEMA}},
                 "required": ["orders"], "additionalProperties": False}


def run_pass(engine, prompts, output_len: int, spec, tag: str) -> dict:
    from qnext import SamplingParams, StructuredOutputsParams

    s = engine.stats
    compiled = s.num_compilations
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=True,
                                structured_outputs=StructuredOutputsParams(json=spec) if spec else None)
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    decode_s, decode_tokens, mask_s, masks = 0.0, 0, s.structured_mask_seconds, s.num_structured_masks
    step_times = []
    finished = {}
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        rows, tokens, generated = s.num_scheduled_sequences, s.num_scheduled_tokens, s.num_generated_tokens
        t0 = time.perf_counter()
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.outputs[0]
        dt = time.perf_counter() - t0
        if s.num_scheduled_tokens - tokens == s.num_scheduled_sequences - rows == len(prompts):   # full decode step
            decode_s += dt
            decode_tokens += s.num_generated_tokens - generated
            step_times.append(dt)
    total = time.perf_counter() - t_start
    for rid in ids:
        engine.release(rid)
    if spec:        # every output is a prefix the schema accepts (checked by a fresh matcher)
        for out in finished.values():
            m = engine.grammar_compiler().compile(StructuredOutputsParams(json=spec))
            assert m.consume_tokens(out.token_ids), out.text[:200]
    return {"seconds": total, "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
            "decode_steps_seconds": decode_s, "decode_tokens": decode_tokens,
            "decode_step_ms_p50": 1e3 * float(np.median(step_times)) if step_times else None,
            "mask_ms_per_decode_step": (1e3 * (s.structured_mask_seconds - mask_s) / max(1, len(step_times))),
            "mask_us_per_row_token": (1e6 * (s.structured_mask_seconds - mask_s) / (s.num_structured_masks - masks)
                                      if s.num_structured_masks > masks else None),
            "compilations": s.num_compilations - compiled,
            "finish_reasons": sorted({o.finish_reason for o in finished.values()})}


def bench_engine(args, log) -> dict:
    import qnext
    from qnext import StructuredOutputsParams

    preset = PRESETS[args.model]
    path = bench_checkpoint(args.model, Path(args.out_dir) / "checkpoints")
    b_max = max(args.batches)
    llm = qnext.LLM(path, max_num_seqs=b_max, max_num_batched_tokens=preset.max_num_batched_tokens,
                    max_model_len=-(-(args.input_len + args.output_len + 1) // 16) * 16, block_size=16,
                    max_num_snapshots=2 * b_max, seed=0)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    t0 = time.perf_counter()
    engine.grammar_compiler()
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.validate_structured_outputs(qnext.SamplingParams(structured_outputs=StructuredOutputsParams(
        json=ENGINE_SCHEMA)))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.validate_structured_outputs(qnext.SamplingParams(structured_outputs=StructuredOutputsParams(
        json=ENGINE_SCHEMA)))
    cached_s = time.perf_counter() - t0
    # tokenizer_setup_ms: what was left of llguidance's tokenizer build (it starts with the engine, in the background)
    result = {"model": args.model, "vocab_size": vocab, "input_len": args.input_len, "output_len": args.output_len,
              "tokenizer_setup_ms": 1e3 * setup_s, "schema_compile_ms": 1e3 * compile_s,
              "schema_cached_compile_ms": 1e3 * cached_s, "batches": []}
    log(f"[engine] {args.model}: llguidance tokenizer {1e3 * setup_s:.1f} ms, schema compile {1e3 * compile_s:.2f} ms "
        f"(cached {1e3 * cached_s:.3f} ms)")
    rng = np.random.default_rng(0)
    for b in args.batches:
        prompts = [rng.integers(3, vocab - 30, args.input_len).tolist() for _ in range(b)]
        modes = {"none": None, "json": ENGINE_SCHEMA}
        for name, spec in modes.items():      # warm-up passes: every shape and sampler variant compiles here
            run_pass(engine, [[(t * 7 + 11) % (vocab - 40) + 3 for t in p] for p in prompts], 8, spec,
                     f"warm-{name}-{b}")
        passes = {name: [] for name in modes}
        for r in range(args.repeats):
            for m, (name, spec) in enumerate(modes.items()):     # new tokens each pass: no prefix-cache hits
                again = [[(t * (2 * r + 3) + 7 * r + 13 * m) % (vocab - 40) + 3 for t in p] for p in prompts]
                p = run_pass(engine, again, args.output_len, spec, f"{name}-{b}-{r}")
                passes[name].append(p)
                log(f"[engine] batch {b} {name:4} pass {r + 1}: {p['decode_tokens_per_s']:.1f} decode tok/s, "
                    f"mask {p['mask_us_per_row_token'] or 0:.1f} us a row and token, {p['compilations']} compiled")
        best = {name: max(ps, key=lambda x: x["decode_tokens_per_s"]) for name, ps in passes.items()}
        row = {"batch": b, **{name: dict(best[name], passes=[x["decode_tokens_per_s"] for x in ps])
                              for name, ps in passes.items()}}
        row["json_slowdown"] = 1 - best["json"]["decode_tokens_per_s"] / best["none"]["decode_tokens_per_s"]
        step = {name: float(np.median([x["decode_step_ms_p50"] for x in ps])) for name, ps in passes.items()}
        row["decode_step_ms_median_of_passes"] = step
        row["json_slowdown_median_step"] = step["json"] / step["none"] - 1
        # each json pass against the none pass just before it: the host's load drifts over minutes, less in seconds
        paired = [1 - j["decode_tokens_per_s"] / n["decode_tokens_per_s"]
                  for n, j in zip(passes["none"], passes["json"])]
        row["json_slowdown_paired_median"] = float(np.median(paired))
        row["json_slowdown_paired"] = paired
        log(f"[engine] batch {b}: none {best['none']['decode_tokens_per_s']:.1f} tok/s, json "
            f"{best['json']['decode_tokens_per_s']:.1f} tok/s ({100 * row['json_slowdown']:+.1f}% slower); median "
            f"decode step {step['none']:.1f} vs {step['json']:.1f} ms "
            f"({100 * row['json_slowdown_median_step']:+.1f}%); "
            f"paired passes: median {100 * row['json_slowdown_paired_median']:+.1f}% slower")
        result["batches"].append(row)
    return result


def bench_libraries(args, log) -> dict:
    from qnext.bench.synthetic_tokenizer import synthetic_tokenizer
    from qnext.testing.tiny_tokenizer import build_tiny_tokenizer, tiny_eos_token_id

    out = {}
    log("[libraries] tiny tokenizer, vocabulary 512")
    out["512"] = compare(build_tiny_tokenizer(512), tiny_eos_token_id(), log=log)
    for size in args.large_vocab:
        cache = Path(args.out_dir) / f"synthetic-tokenizer-{size}.json"
        if cache.is_file():
            import tokenizers
            tok = tokenizers.Tokenizer.from_file(str(cache))
        else:
            log(f"[libraries] building a synthetic byte-level vocabulary of {size}")
            tok = synthetic_tokenizer(size)
            cache.parent.mkdir(parents=True, exist_ok=True)
            tok.save(str(cache))
        log(f"[libraries] synthetic tokenizer, vocabulary {size}")
        out[str(size)] = compare(tok, tok.token_to_id("<|endoftext|>"), log=log,
                                 libraries=args.libraries)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", choices=sorted(PRESETS))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--large-vocab", default="248320", help="synthetic vocabulary sizes ('' for none)")
    ap.add_argument("--libraries", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--lib-path", default=None, help="a folder with xgrammar / outlines-core, added to sys.path")
    ap.add_argument("--skip", default="", help="'engine' or 'libraries'")
    ap.add_argument("--out-dir", default=str(Path.home() / ".cache" / "qnext-bench"))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.large_vocab = [int(v) for v in args.large_vocab.split(",") if v]
    args.libraries = tuple(args.libraries.split(","))
    if args.lib_path:
        sys.path.append(args.lib_path)

    def log(msg):
        print(msg, flush=True)

    report = {}
    if "libraries" not in args.skip:
        report["libraries"] = bench_libraries(args, log)
    if "engine" not in args.skip:
        report["engine"] = bench_engine(args, log)
    if args.json_out:            # parts skipped now keep their numbers from an earlier run
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(out.read_text()) if out.is_file() else {}
        out.write_text(json.dumps({**old, **report}, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
