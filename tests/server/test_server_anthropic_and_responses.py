"""The agent APIs as clients use them: `qnext serve` (a tiny Qwen3.5 checkpoint with a 64k context and the
Qwen3.5-format template, random weights) in a
subprocess with an API key, driven by the official anthropic and openai SDKs. Anthropic Messages and OpenAI
Responses, streamed and not: text, forced tool use valid against the schema, a tool-result turn whose usage
reports prefix-cache reads, thinking, count_tokens, error shapes, 401 without the key; the recorded first requests
of Claude Code and Codex are replayed and answered 200. One server for the module."""
from __future__ import annotations

import json
import time
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from qnext.server.launch import running_server
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

MODEL, SMALL_MODEL = "qnext-tiny-demo", "claude-small-alias"
KEY = "test-key-123"
MAX_MODEL_LEN = 65536
FIXTURES = Path(__file__).parent / "fixtures"
SERVER_ARGS = ["--api-key", KEY, "--served-model-name", MODEL, SMALL_MODEL, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", "4", "--max-num-batched-tokens", "2048", "--no-warm-up", "--log-level", "warning"]
WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "days": {"type": "integer", "minimum": 1,
                                                                      "maximum": 5}},
                            "required": ["city", "days"], "additionalProperties": False}}
SYSTEM = "You are a weather assistant. Call get_weather for any question about the weather, then answer briefly."
# The tiny checkpoint's greedy choice is its eos token; sampled with a seed, it writes text (vLLM's extra fields).
SAMPLED = {"seed": 7, "min_tokens": 2}
# The tiny checkpoint's eos id is also the text token '#', which a forced call's string may contain: the request
# ends when the call's grammar is complete instead.
FORCED = {"seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents")
    checkpoint = write_tiny_checkpoint(tmp / "tiny-64k", "qwen3_5", seed=0, max_position_embeddings=MAX_MODEL_LEN)
    with running_server([str(checkpoint), *SERVER_ARGS], timeout=300, log_path=tmp / "server.log",
                        env={"JAX_PLATFORMS": "cpu", "QNEXT_COMPILATION_CACHE_DIR": str(tmp / "jax")}) as proc:
        yield proc


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, timeout=300, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, timeout=300, max_retries=0) as c:
        yield c


def cached_tokens_metric(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("qnext:prefix_cache_hits_total"))


# ---- keys -------------------------------------------------------------------------------------------------------
def test_keys_on_each_api(server):
    base = server.base_url
    assert httpx.get(base + "/health", timeout=10).status_code == 200           # open
    r = httpx.post(base + "/v1/messages?beta=true", json={}, timeout=10)
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(base + "/v1/responses", json={}, headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(base + "/v1/models", headers={"x-api-key": KEY}, timeout=10)      # x-api-key: Anthropic only
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL, SMALL_MODEL]
    with anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with anthropic.Anthropic(base_url=base, auth_token=KEY, max_retries=0, timeout=300) as bearer:
        reply = bearer.messages.create(model=SMALL_MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.model == SMALL_MODEL and reply.usage.output_tokens >= 1
    with openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.responses.create(model=MODEL, input="hi", max_output_tokens=4)


# ---- Anthropic Messages -----------------------------------------------------------------------------------------
def test_messages_text_streamed_and_not(claude):
    kwargs = dict(model=MODEL, max_tokens=8, system=[{"type": "text", "text": SYSTEM,
                                                      "cache_control": {"type": "ephemeral"}}],
                  messages=[{"role": "user", "content": "Hello there"}], extra_body={**SAMPLED, "top_k": 40},
                  thinking={"type": "disabled"}, stop_sequences=["\u2603"])
    whole = claude.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason in ("end_turn", "max_tokens") and 1 <= whole.usage.output_tokens <= 8
    assert whole.usage.cache_creation_input_tokens == 0
    with claude.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]      # seeded
    assert streamed.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_messages_forced_tool_use_is_valid_against_the_schema(claude, stream):
    kwargs = dict(model=MODEL, max_tokens=200, system=SYSTEM, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, thinking={"type": "disabled"},
                  messages=[{"role": "user", "content": "Weather in Oslo?"}], extra_body=FORCED)
    if stream:
        with claude.messages.stream(**kwargs) as s:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
            message = s.get_final_message()
        assert ("content_block_delta", "input_json_delta") in kinds
    else:
        message = claude.messages.create(**kwargs)
    calls = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])


def test_tool_result_turn_reports_cache_reads(claude, server):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = claude.messages.create(model=MODEL, max_tokens=200, system=SYSTEM, tools=[WEATHER],
                                   tool_choice={"type": "any"}, thinking={"type": "disabled"}, messages=messages,
                                   extra_body=FORCED)
    call = next(b for b in first.content if b.type == "tool_use")
    before = cached_tokens_metric(server)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    second = claude.messages.create(model=MODEL, max_tokens=6, system=SYSTEM, tools=[WEATHER],
                                    thinking={"type": "disabled"}, messages=messages)
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert cached_tokens_metric(server) - before >= second.usage.cache_read_input_tokens


def test_thinking_blocks_streamed_and_not(claude):
    kwargs = dict(model=MODEL, max_tokens=6, thinking={"type": "enabled", "budget_tokens": 1024},
                  messages=[{"role": "user", "content": "Think about the sea."}], extra_body=SAMPLED)
    whole = claude.messages.create(**kwargs)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    with claude.messages.stream(**kwargs) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "thinking_delta" in deltas and final.content[0].type == "thinking"


def test_count_tokens_matches_the_prompt(claude):
    kwargs = dict(model=MODEL, system=SYSTEM, tools=[WEATHER], messages=[{"role": "user", "content": "Oslo?"}],
                  thinking={"type": "disabled"})
    counted = claude.messages.count_tokens(**kwargs).input_tokens
    reply = claude.messages.create(max_tokens=1, **kwargs)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 50


def test_messages_errors_in_anthropic_shape(claude, server):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-opus-9", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and MODEL in e.value.body["error"]["message"]
    headers = {"x-api-key": KEY}
    for body, where in [({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {}}]}]}, "image"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                          "tool_choice": {"type": "tool", "name": "nope"},
                          "tools": [WEATHER]}, "nope")]:
        r = httpx.post(server.base_url + "/v1/messages?beta=true", json=body, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and where in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/messages", content=b"{not json", headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ---- OpenAI Responses ------------------------------------------------------------------------------------------
def test_responses_text_streamed_and_not(oai):
    kwargs = dict(model=MODEL, instructions=SYSTEM, input="Hello there", max_output_tokens=8,
                  reasoning={"effort": "none"}, extra_body=SAMPLED)
    whole = oai.responses.create(**kwargs)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output[-1].type == "message" and whole.output_text
    assert whole.usage.input_tokens > 0 and 1 <= whole.usage.output_tokens <= 8
    events = list(oai.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_call_is_valid_against_the_schema(oai, stream):
    tool = {"type": "function", "name": "get_weather", "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"], "strict": True}
    kwargs = dict(model=MODEL, instructions=SYSTEM, input="Weather in Oslo?", tools=[tool],
                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
                  reasoning={"effort": "none"}, extra_body=FORCED)
    if stream:
        events = list(oai.responses.create(stream=True, **kwargs))
        assert "response.function_call_arguments.delta" in [e.type for e in events]
        response = events[-1].response
    else:
        response = oai.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["input_schema"])


def test_function_call_output_turn_reports_cached_tokens_and_previous_response_id(oai):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}
    first = oai.responses.create(model=MODEL, instructions=SYSTEM, input="Weather in Oslo?", tools=[tool],
                                 tool_choice="required", max_output_tokens=200, reasoning={"effort": "none"},
                                 extra_body=FORCED)
    call = next(item for item in first.output if item.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    stateless = oai.responses.create(model=MODEL, instructions=SYSTEM, tools=[tool], max_output_tokens=4,
                                     reasoning={"effort": "none"}, store=False,
                                     input=[{"role": "user", "content": "Weather in Oslo?"},
                                            *[item.model_dump(exclude_none=True) for item in first.output], output])
    assert stateless.usage.input_tokens_details.cached_tokens > 0
    chained = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[output], tools=[tool],
                                   max_output_tokens=4, reasoning={"effort": "none"})
    assert chained.usage.input_tokens == stateless.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:               # store=False: not kept
        oai.responses.create(model=MODEL, previous_response_id=stateless.id, input="next", max_output_tokens=4)
    assert "previous_response_id" in e.value.message


def test_responses_reasoning_items(oai):
    response = oai.responses.create(model=MODEL, input="Think about the sea.", max_output_tokens=6,
                                    reasoning={"effort": "high"}, extra_body=SAMPLED)
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(oai.responses.create(model=MODEL, input="Think about the sea.", max_output_tokens=6,
                                       reasoning={"effort": "high"}, stream=True, extra_body=SAMPLED))
    assert "response.reasoning_text.delta" in [e.type for e in events]


def test_responses_errors_in_openai_shape(oai, server):
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-9", input="hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", tools=[{"type": "file_search", "vector_store_ids": []}])
    assert "file_search" in e.value.message
    r = httpx.post(server.base_url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 0},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


# ---- bounds ----------------------------------------------------------------------------------------------------
def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def refuse_huge_requests(server) -> None:
    """50 MB bodies (declared, and chunked) get 413, prompts of 10x max_model_len characters 400, each within a
    second."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def body():
        for _ in range(50):
            yield b" " * (1 << 20)
    for path, extra in [("/v1/chat/completions", {"Content-Length": str(50 << 20)}), ("/v1/messages", {})]:
        start = time.monotonic()
        try:
            r = httpx.post(server.base_url + path, content=body(), headers={**headers, **extra}, timeout=30)
            assert r.status_code == 413, r.text
            assert "request_too_large" in (r.json()["error"].get("code"), r.json()["error"]["type"])
        except httpx.WriteError:
            pass                   # the server answered and closed while the body was still being sent
        assert time.monotonic() - start < 1.0
    prompt = "sea " * (MAX_MODEL_LEN * 10 // 4)
    for path, body_json in [("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}),
                            ("/v1/messages", {"model": MODEL, "max_tokens": 1,
                                              "messages": [{"role": "user", "content": prompt}]})]:
        start = time.monotonic()
        r = httpx.post(server.base_url + path, headers=headers, json=body_json, timeout=30)
        assert r.status_code == 400 and "characters" in r.text, r.text
        assert time.monotonic() - start < 1.0


def test_huge_bodies_and_prompts_are_refused_fast_and_memory_stays_flat(server):
    refuse_huge_requests(server)                  # (the first round also allocates what the server keeps)
    peak_before = peak_rss_bytes(server.proc.pid)
    refuse_huge_requests(server)
    refuse_huge_requests(server)
    # The server's peak memory did not move by anything like a 50 MB body: none sat in memory.
    assert peak_rss_bytes(server.proc.pid) - peak_before < 25 * 1024 * 1024


# ---- recorded client requests ----------------------------------------------------------------------------------
def shortened(value, limit: int = 200):
    """Every string of a recorded body cut to `limit` characters: the same fields, blocks, items and tool schemas
    at a few thousand prompt tokens instead of 50k (the full-size requests are run by hand: docs/agents.md)."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [shortened(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: shortened(v, limit) if k not in ("input_schema", "parameters") else v for k, v in value.items()}
    return value


@pytest.mark.parametrize("name", ["claude_code_first_request", "codex_first_request"])
def test_recorded_agent_requests_are_answered(server, name):
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    body = shortened(fixture["body"])
    auth = {"x-api-key": KEY} if fixture["path"].startswith("/v1/messages") else {"Authorization": f"Bearer {KEY}"}
    body["model"] = MODEL
    if "max_output_tokens" in body or fixture["path"].startswith("/v1/responses"):
        body["max_output_tokens"] = 4
    else:
        body["max_tokens"] = 4                     # recorded: 32000, clamped to the room left anyway
    with httpx.stream("POST", server.base_url + fixture["path"], json=body, timeout=600,
                      headers={**fixture["headers"], **auth}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] in ("message_stop", "response.completed", "response.incomplete"), events[-1]
