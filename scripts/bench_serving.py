"""Serving benchmark: a multi-turn chat load against the OpenAI-compatible server, prefix caching on vs off.

    python scripts/bench_serving.py                               # tiny demo model, two servers on loopback
    python scripts/bench_serving.py --model DIR --server-args "--max-num-seqs 32 --max-num-batched-tokens 512"
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000   # an already running server, one run

Workload (in the spirit of vLLM's benchmark_serving, multi-turn): --conversations chats, each with --turns user
turns; every chat opens with one of --system-prompts shared system prompts; a turn is sent once the previous reply
has arrived, with the reply in the history. Conversations start as a Poisson process whose rate is
--request-rate / --turns (so requests arrive at about --request-rate per second while the server keeps up; inf:
all at once), with at most --max-concurrency conversations in flight. Greedy, --max-tokens per reply, EOS ignored,
so every run generates the same number of tokens.

Reports request throughput, output tokens/s, TTFT / TPOT / end-to-end latency p50 / p90 / p99, and the share of
prompt tokens served from the prefix cache (usage.prompt_tokens_details), as a table and as JSON (--json-out).

--workload agent: tool-using sessions instead of chats (qnext/bench/agent_workload.py): a ~4k-token system prompt
and 12 tool schemas (~3k tokens more) shared by every session, 6 user turns of 2 forced tool calls each, reasoning on (bounded by
thinking_token_budget) and dropped by the template at each new user turn. Adds how many forced calls validated
against their schema and, per reason, which prompt tokens were computed rather than served from the cache.

    python scripts/bench_serving.py --workload agent --json-out bench_out/serving-agent.json"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qnext.optional import optional_import  # noqa: E402

CHAT_SERVER_ARGS = "--max-num-seqs 8 --max-num-batched-tokens 64 --max-model-len 512"
AGENT_SERVER_ARGS = "--max-num-seqs 8 --max-num-batched-tokens 1024 --max-model-len 16384"
WORDS = ("the sea ship light keeper storm night wind wave harbour rock coast bell fog boat sailor map star north "
         "south tide rope lamp tower island bird rain cloud morning evening story old new small great quiet").split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_conversations(args) -> list[list[dict]]:
    """Per conversation: [system message, user turn 1, user turn 2, ...] (replies are added as they come)."""
    rng = random.Random(args.seed)
    systems = [f"You are assistant number {i}. " + words(rng, args.system_words) for i in range(args.system_prompts)]
    return [[{"role": "system", "content": systems[c % len(systems)]}]
            + [{"role": "user", "content": words(rng, args.user_words)} for _ in range(args.turns)]
            for c in range(args.conversations)]


async def chat_turn(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int,
                    timeout: float) -> tuple[RequestResult, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result, text = RequestResult(ok=False), []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"), ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(ok=False, error=chunk["error"]["message"]), ""
                for choice in chunk.get("choices", []):
                    content = choice["delta"].get("content")
                    if content:
                        if not text:
                            result.ttft = time.perf_counter() - start
                        text.append(content)
                if chunk.get("usage"):
                    u = chunk["usage"]
                    details = u.get("prompt_tokens_details") or {}
                    result.output_tokens, result.prompt_tokens = u["completion_tokens"], u["prompt_tokens"]
                    result.cached_tokens = details.get("cached_tokens", 0)
                    result.recomputed_tokens = details.get("recomputed_tokens", 0)
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        return RequestResult(ok=False, error=repr(e)), ""
    result.e2e = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    result.ttft = result.ttft or result.e2e
    return result, "".join(text)


async def run_conversation(client, model, script, args, results: list[RequestResult]) -> None:
    messages = [script[0]]
    for user in script[1:]:
        messages.append(user)
        result, reply = await chat_turn(client, model, messages, args.max_tokens, args.request_timeout)
        results.append(result)
        if not result.ok:
            return
        messages.append({"role": "assistant", "content": reply})


async def run_load(base_url: str, model: str, conversations: list[list[dict]], args) -> tuple[list, float]:
    rng = np.random.default_rng(args.seed)
    rate = args.request_rate / args.turns
    limits = httpx.Limits(max_connections=max(args.max_concurrency, 1) + 4)
    semaphore = asyncio.Semaphore(args.max_concurrency)
    results: list[RequestResult] = []

    async def one(script):
        async with semaphore:
            await run_conversation(client, model, script, args, results)

    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for script in conversations:
            tasks.append(asyncio.create_task(one(script)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        _, pending = await asyncio.wait(tasks, timeout=args.max_duration)
        for t in pending:
            t.cancel()
        duration = time.perf_counter() - start
    return results, duration


def summarize(label: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def pct(values, q):
        return float(np.percentile(values, q)) * 1000 if values else float("nan")

    ttft, e2e = [r.ttft for r in ok], [r.e2e for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    summary = {"run": label, "requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
               "request_throughput": len(ok) / duration, "output_tokens_per_s": sum(r.output_tokens for r in ok)
               / duration, "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in ok),
               "recomputed_tokens": sum(r.recomputed_tokens for r in ok),
               "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = pct(values, q)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def table(summaries: list[dict]) -> str:
    head = (f"{'run':<16}{'reqs':>6}{'fail':>5}{'req/s':>8}{'out tok/s':>10}{'cached':>8}"
            f"{'TTFT p50/p90/p99 ms':>24}{'TPOT p50/p90/p99 ms':>22}{'E2E p50/p90/p99 ms':>24}")
    lines = [head, "-" * len(head)]
    for s in summaries:
        def trio(name, fmt):
            return "/".join(format(s[f"{name}_p{q}_ms"], fmt) for q in (50, 90, 99))
        lines.append(f"{s['run']:<16}{s['requests']:>6}{s['failed']:>5}{s['request_throughput']:>8.2f}"
                     f"{s['output_tokens_per_s']:>10.1f}{s['cache_hit_rate']:>8.1%}{trio('ttft', '.0f'):>24}"
                     f"{trio('tpot', '.1f'):>22}{trio('e2e', '.0f'):>24}")
    return "\n".join(lines)


# ---- the agent workload ----------------------------------------------------------------------------------------
@dataclass
class AgentCall:
    """One streamed forced-tool-call request, as the bench saw it."""
    result: RequestResult
    reasoning: str = ""
    content: str = ""
    tool_calls: list = None
    prompt_ids: list = None
    output_ids: list = None


async def agent_call(client: httpx.AsyncClient, body: dict, timeout: float) -> AgentCall:
    start = time.perf_counter()
    call = AgentCall(RequestResult(ok=False), tool_calls=[], prompt_ids=[], output_ids=[])
    calls: dict[int, dict] = {}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                call.result.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return call
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    call.result.error = chunk["error"]["message"]
                    return call
                call.prompt_ids = chunk.get("prompt_token_ids") or call.prompt_ids
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    call.output_ids.extend(choice.get("token_ids") or [])
                    got = delta.get("reasoning_content") or delta.get("content") or delta.get("tool_calls")
                    if got and not call.result.ttft:
                        call.result.ttft = time.perf_counter() - start
                    call.reasoning += delta.get("reasoning_content") or ""
                    call.content += delta.get("content") or ""
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                              "function": {"name": "", "arguments": ""}})
                        slot["id"] = tc.get("id") or slot["id"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                if chunk.get("usage"):
                    u = chunk["usage"]
                    details = u.get("prompt_tokens_details") or {}
                    call.result.output_tokens, call.result.prompt_tokens = u["completion_tokens"], u["prompt_tokens"]
                    call.result.cached_tokens = details.get("cached_tokens", 0)
                    call.result.recomputed_tokens = details.get("recomputed_tokens", 0)
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        call.result.error = repr(e)
        return call
    call.tool_calls = [calls[i] for i in sorted(calls)]
    call.result.e2e = time.perf_counter() - start
    call.result.ttft = call.result.ttft or call.result.e2e
    call.result.ok = call.result.output_tokens > 0
    if call.result.ok and not call.tool_calls:
        call.result.ok, call.result.error = False, "a forced tool call came back without tool_calls"
    return call


def valid_call(call: dict, tools_by_name: dict) -> bool:
    jsonschema = optional_import("jsonschema", "bench", "checking tool-call arguments against their schema")

    tool = tools_by_name.get(call["function"]["name"])
    if tool is None:
        return False
    try:
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
        return True
    except (ValueError, TypeError, jsonschema.ValidationError):
        return False


async def run_agent_load(base_url: str, model: str, args, seed: int, earlier: list = ()) -> dict:
    from qnext.bench.agent_workload import AgentWorkload, SentRequest, explain_recompute, tool_result_message
    from qnext.bench.agent_workload import tool_schemas

    w = AgentWorkload(sessions=args.sessions, turns=args.agent_turns, calls_per_turn=args.calls_per_turn,
                      system_tokens=args.system_tokens, num_tools=args.tools, max_tokens=args.call_max_tokens,
                      thinking_token_budget=args.thinking_token_budget, seed=seed)
    tools = tool_schemas(w.num_tools)
    by_name = {t["function"]["name"]: t for t in tools}
    system = w.system_prompt(WORDS)
    sent: list[SentRequest] = []
    finished_before: list[list[int]] = []
    finished: list[int] = []
    results: list[RequestResult] = []
    num_valid, num_calls, invalid = 0, 0, []

    async def session(k: int, client: httpx.AsyncClient) -> None:
        nonlocal num_valid, num_calls
        messages = [{"role": "system", "content": system}]
        for turn in range(w.turns):
            messages.append({"role": "user", "content": w.user_message(k, turn, WORDS)})
            for c in range(w.calls_per_turn):
                index = len(sent)
                sent.append(SentRequest([], [], 0, 0))
                finished_before.append(list(finished))
                body = w.request_body(model, messages, tools, seed=seed * 100_000 + index)
                call = await agent_call(client, body, args.request_timeout)
                results.append(call.result)
                sent[index] = SentRequest(call.prompt_ids, call.output_ids, call.result.cached_tokens,
                                          call.result.recomputed_tokens, session=k)
                finished.append(index)
                if not call.result.ok:
                    return
                for tc in call.tool_calls:
                    ok = valid_call(tc, by_name)
                    num_valid, num_calls = num_valid + ok, num_calls + 1
                    if not ok:
                        invalid.append(tc["function"])
                messages.append({"role": "assistant", "content": call.content, "tool_calls": call.tool_calls,
                                 **({"reasoning_content": call.reasoning} if call.reasoning else {})})
                messages.extend(tool_result_message(tc, turn) for tc in call.tool_calls)

    limits = httpx.Limits(max_connections=max(args.max_concurrency, 1) + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        start = time.perf_counter()
        semaphore = asyncio.Semaphore(args.max_concurrency)

        async def one(k):
            async with semaphore:
                await session(k, client)

        tasks = [asyncio.create_task(one(k)) for k in range(w.sessions)]
        _, pending = await asyncio.wait(tasks, timeout=args.max_duration)
        for t in pending:
            t.cancel()
        duration = time.perf_counter() - start
    done = [i for i in finished if sent[i].prompt_ids]
    position = {i: k for k, i in enumerate(done)}
    reasons = explain_recompute([sent[i] for i in done], [[position[j] for j in finished_before[i] if j in position]
                                                          for i in done], args.block_size, earlier)
    return {"results": results, "duration": duration, "tool_calls_valid": num_valid, "tool_calls": num_calls,
            "invalid_calls": invalid[:5], "recompute": reasons,
            "per_request": [dict(prompt=len(sent[i].prompt_ids), **sent[i].reasons) for i in done],
            "sent": [sent[i] for i in done]}


def agent_table(summaries: list[dict]) -> str:
    head = (f"{'run':<16}{'reqs':>6}{'fail':>5}{'valid calls':>12}{'prompt tok':>11}{'cached':>8}"
            f"{'TTFT p50/p90 ms':>18}{'appended':>9}{'rerendered':>11}{'straddle':>9}{'no state':>9}{'other':>7}")
    lines = [head, "-" * len(head)]
    for s in summaries:
        r = s["recompute"]
        lines.append(f"{s['run']:<16}{s['requests']:>6}{s['failed']:>5}"
                     f"{str(s['tool_calls_valid']) + '/' + str(s['tool_calls']):>12}"
                     f"{s['prompt_tokens']:>11}{s['cache_hit_rate']:>8.1%}"
                     f"{s['ttft_p50_ms']:>10.0f}/{s['ttft_p90_ms']:<7.0f}{r['appended']:>9}{r['rerendered']:>11}"
                     f"{r['straddle']:>9}"
                     f"{r['missing_state']:>9}{r['other']:>7}")
    return "\n".join(lines)


async def bench_one(base_url: str, label: str, args) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
    if args.workload == "agent":
        warm = argparse.Namespace(**{**vars(args), "sessions": 1, "agent_turns": 2})
        warm_run = await run_agent_load(base_url, model, warm, seed=args.seed + 1)    # compile paths, not timed
        run = await run_agent_load(base_url, model, args, seed=args.seed, earlier=warm_run["sent"])
        summary = summarize(label, run["results"], run["duration"])
        summary.update({k: run[k] for k in ("tool_calls_valid", "tool_calls", "invalid_calls", "recompute",
                                             "per_request")})
        return summary
    warm = argparse.Namespace(**{**vars(args), "conversations": 2, "seed": args.seed + 1})
    await run_load(base_url, model, make_conversations(warm), warm)       # compile sampler paths, not timed
    results, duration = await run_load(base_url, model, make_conversations(args), args)
    return summarize(label, results, duration)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="bench this running server once instead of starting two")
    p.add_argument("--model", help="checkpoint for the servers this script starts (default: the tiny demo)")
    p.add_argument("--server-args", help="extra `qnext serve` flags for the servers this script starts (default: "
                   f"chat {CHAT_SERVER_ARGS!r}, agent {AGENT_SERVER_ARGS!r})")
    p.add_argument("--block-size", type=int, default=16, help="the server's block size (agent: recompute reasons)")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-words", type=int, default=60, help="words per shared system prompt")
    p.add_argument("--user-words", type=int, default=12, help="words per user turn")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per reply")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: no pacing")
    p.add_argument("--max-concurrency", type=int, default=8, help="conversations in flight at most")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds a run may take; the rest is cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", help="write the summaries here")
    p.add_argument("--workload", choices=("chat", "agent"), default="chat")
    p.add_argument("--only-cache-on", action="store_true",
                   help="run the prefix-cache-on server only (the cache's numbers without the cold baseline)")
    p.add_argument("--sessions", type=int, default=6, help="agent: sessions")
    p.add_argument("--agent-turns", type=int, default=6, help="agent: user turns per session")
    p.add_argument("--calls-per-turn", type=int, default=2, help="agent: forced tool calls per user turn")
    p.add_argument("--system-tokens", type=int, default=4000, help="agent: about this many system prompt tokens")
    p.add_argument("--tools", type=int, default=12, help="agent: tool schemas in every request")
    p.add_argument("--call-max-tokens", type=int, default=192, help="agent: max_tokens of a forced-call request")
    p.add_argument("--thinking-token-budget", type=int, default=16, help="agent: reasoning tokens per request")
    return p.parse_args(argv)


def agent_checkpoint() -> Path:
    """The tiny Qwen3.5 checkpoint (random weights, the demo's tokenizer and template) with a 16k context and
    `<|im_end|>` as its eos, as in Qwen releases."""
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
    from qnext.testing.tiny_tokenizer import tiny_eos_token_id

    path = Path(tempfile.mkdtemp(prefix="qnext-bench-agent-")) / "ckpt"     # fresh: the template may change
    return write_tiny_checkpoint(path, "qwen3_5", seed=0, max_position_embeddings=16384,
                                 eos_token_id=tiny_eos_token_id(512))


def main(argv=None) -> int:
    args = parse_args(argv)
    from qnext.server.launch import running_server

    summaries = []
    if args.server_args is None:
        args.server_args = AGENT_SERVER_ARGS if args.workload == "agent" else CHAT_SERVER_ARGS
    model = args.model
    if model is None and args.workload == "agent":         # the demo's 512-token context is too short
        model = str(agent_checkpoint())
    if args.base_url:
        summaries.append(asyncio.run(bench_one(args.base_url, "server", args)))
    else:
        runs = (("prefix-cache on", "--enable-prefix-caching"), ("prefix-cache off", "--no-enable-prefix-caching"))
        for label, flag in runs[:1] if args.only_cache_on else runs:
            server_args = ([model] if model else []) + shlex.split(args.server_args) + [
                flag, "--block-size", str(args.block_size), "--log-level", "warning"]
            log = Path(tempfile.gettempdir()) / f"qnext-bench-serving-{flag.strip('-')}.log"
            print(f"starting the server ({label}): qnext serve {' '.join(server_args)}", file=sys.stderr)
            with running_server(server_args, timeout=900, log_path=log) as server:
                summaries.append(asyncio.run(bench_one(server.base_url, label, args)))
    print(agent_table(summaries) if args.workload == "agent" else table(summaries))
    return report(summaries, args.json_out, args)


def report(summaries: list[dict], json_out: str | None, args) -> int:
    """Writes the runs to json_out (when given) -> the exit status: 0 when no request failed."""
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps({"args": vars(args), "runs": summaries}, indent=2, default=str))
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
