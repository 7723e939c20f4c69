"""The HTTP server as a user runs it: `python -m qnext.server` in a subprocess on a free loopback port (the tiny
demo checkpoint), driven by the official openai client and raw httpx. One server for the module; the last test
stops it with SIGTERM and checks that it drains and exits 0."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qnext.server.launch import running_server

MODEL = "qnext-tiny-demo"
MAX_MODEL_LEN = 256
SERVER_ARGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-waiting-requests", "64", "--shutdown-timeout", "30", "--log-level", "info"]
SYSTEM = ("You are a helpful assistant who answers questions about lighthouses, ships, the sea and the weather "
          "in short plain sentences.")
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(SERVER_ARGS, timeout=300, log_path=tmp_path_factory.mktemp("server") / "server.log",
                        env={"JAX_PLATFORMS": "cpu"}) as proc:
        yield proc


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60, max_retries=0) as c:
        yield c


def metrics(server) -> dict[str, float]:
    """Sample name -> value, summed over label sets."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_idle(server, timeout: float = 20.0) -> dict[str, float]:
    """Metrics once no request runs or waits and no KV block or state row is referenced."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["qnext:num_requests_running"] == 0 and m["qnext:num_requests_waiting"] == 0
                and m["qnext:kv_cache_usage_perc"] == 0 and m["qnext:state_slots_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_sync_completion_text_and_token_prompt_agree(client):
    first = client.completions.create(model=MODEL, prompt="The lighthouse keeper said", max_tokens=6,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}, temperature=0.0)
    body = first.model_dump()
    assert body["choices"][0]["finish_reason"] == "length"
    assert first.usage.completion_tokens == 6 and len(body["choices"][0]["token_ids"]) == 6
    assert first.usage.prompt_tokens_details.cached_tokens >= 0
    assert "recomputed_tokens" in body["usage"]["prompt_tokens_details"]
    again = client.completions.create(model=MODEL, prompt=body["prompt_token_ids"], max_tokens=6,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}, temperature=0.0)
    assert again.model_dump()["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    assert again.choices[0].text == first.choices[0].text


def test_logprobs_have_the_openai_shapes(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)   # greedy: the top token
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=1, **GREEDY)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3


def test_async_streamed_chat_second_turn_hits_the_cache(server):
    async def turn(client, messages) -> tuple[str, object, list[str]]:
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                      stream_options={"include_usage": True}, **GREEDY)
        text, usage, finishes = [], None, []
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finishes.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
        return "".join(text), usage, finishes

    async def conversation():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60,
                                      max_retries=0) as client:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a lighthouse?"}]
            reply, usage1, finishes = await turn(client, messages)
            assert finishes[-1] == "length" and usage1.completion_tokens == 8
            hits_before = metrics(server)["qnext:prefix_cache_hits_total"]
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a ship?"}]
            _, usage2, _ = await turn(client, messages)
            return usage1, usage2, hits_before

    usage1, usage2, hits_before = asyncio.run(conversation())
    assert usage2.prompt_tokens > usage1.prompt_tokens
    cached = usage2.prompt_tokens_details.cached_tokens
    assert cached > 0, "the second turn should reuse the first turn's prefix"
    assert metrics(server)["qnext:prefix_cache_hits_total"] >= hits_before + cached


async def _stream_tokens(client: httpx.AsyncClient, body: dict) -> list[int]:
    tokens, done = [], False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    assert done
    return tokens


def test_32_concurrent_streams_equal_each_request_alone(server):
    bodies = [{"model": MODEL, "prompt": f"Story {i}: the {['sea', 'ship', 'storm', 'keeper'][i % 4]} and the "
                                        f"light number {i * 7}", "max_tokens": 8, "ignore_eos": True,
               "return_token_ids": True,
               **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i})}
              for i in range(32)]
    alone = [httpx.post(server.base_url + "/v1/completions", json=b, timeout=60).json()["choices"][0]["token_ids"]
             for b in bodies]

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            return await asyncio.wait_for(asyncio.gather(*(_stream_tokens(c, b) for b in bodies)), 240)

    together = asyncio.run(all_at_once())
    assert all(len(t) == 8 for t in together)
    assert together == alone
    wait_idle(server)


def test_n_choices_streamed_and_not(server, client):
    """n=3: three indexed choices with usage summed; streamed, each choice's chunks carry its index and add up to
    the non-streamed choice of the same seed; greedy choices are equal."""
    messages = [{"role": "user", "content": "Tell me about the lighthouse keeper"}]
    sampled = dict(model=MODEL, messages=messages, max_tokens=6, n=3, temperature=1.0, seed=42,
                   extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**sampled)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 18
    texts = ["", "", ""]
    finished = set()
    for chunk in client.chat.completions.create(**sampled, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert texts == [c.message.content for c in whole.choices]
    greedy = client.completions.create(model=MODEL, prompt="The sea", max_tokens=5, n=2, **GREEDY)
    assert len(greedy.choices) == 2 and greedy.choices[0].text == greedy.choices[1].text
    wait_idle(server)


def test_client_disconnect_aborts_and_frees_blocks_and_rows(server):
    before = wait_idle(server)
    assert before["qnext:kv_cache_usage_perc"] == 0 and before["qnext:state_slots_usage_perc"] == 0
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 240, "ignore_eos": True, "temperature": 0.0}
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break                       # leave mid-stream: the response is closed unread
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
            c.post("/v1/completions", json=body, timeout=0.05)
    after = wait_idle(server)
    assert after["qnext:num_requests_running"] == 0 and after["qnext:num_requests_waiting"] == 0
    assert after["qnext:kv_cache_usage_perc"] == 0 and after["qnext:state_slots_usage_perc"] == 0
    finished = "qnext:request_success_total"
    assert after.get(finished, 0.0) == before.get(finished, 0.0), \
        "both requests should have been aborted, not run to their end"
    assert after["qnext:generation_tokens_total"] - before["qnext:generation_tokens_total"] < 2 * 240


BAD_REQUESTS = [  # (endpoint, body, the field or words the message must name)
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1.0}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n must be a positive integer"),
    ("completions", {"prompt": "hello", "n": 5}, "max_num_seqs"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temprature": 0.5}, "temprature"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "base64 data URL"),   # the demo reads pictures; a checkpoint without a tower: tests/server/test_media.py
    ("chat", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "text, image_url and video_url"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "logprobs"),
    ("completions", {"prompt": list(range(1, 301))}, "max_model_len"),
    ("completions", {"prompt": "hello", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"prompt": [5, 100000]}, "vocabulary"),
    ("completions", {"prompt": ["one", "two"]}, "one prompt per request"),
    ("completions", {"prompt": "hello", "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", "{not json", "JSON"),
]


def test_bad_requests_get_400_while_a_stream_completes(server):
    result = {}

    def long_stream():
        body = {"model": MODEL, "prompt": "Meanwhile, at sea", "max_tokens": 48, "ignore_eos": True,
                "temperature": 0.0, "return_token_ids": True}
        result["tokens"] = asyncio.run(_run_one_stream(server.base_url, body))

    worker = threading.Thread(target=long_stream)
    worker.start()
    for endpoint, body, words in BAD_REQUESTS:
        url = server.base_url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
        content = body if isinstance(body, str) else json.dumps({"model": MODEL, **body})
        r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"], (body, error)
        assert set(error) == {"message", "type", "param", "code"}
    wrong_model = httpx.post(server.base_url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=30)
    assert wrong_model.status_code == 404 and "gpt-4" in wrong_model.json()["error"]["message"]
    log = server.log_path.read_text()            # the server's log says why, not only the status
    assert "POST /v1/completions -> 404: " in log and "gpt-4" in log.split("POST /v1/completions -> 404: ")[1]
    worker.join(120)
    assert len(result["tokens"]) == 48
    assert metrics(server)["qnext:request_errors_total"] >= len(BAD_REQUESTS)
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


async def _run_one_stream(base_url: str, body: dict) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
        return await _stream_tokens(c, body)


def test_sigterm_drains_in_flight_requests_and_exits_0(server):
    """Runs last: it stops the module's server."""
    body = {"model": MODEL, "prompt": "One last story", "max_tokens": 64, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "return_token_ids": True}
    tokens, done, terminated = [], False, False
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    if tokens and not terminated:
                        server.terminate()           # mid-stream
                        terminated = True
                done |= line == "data: [DONE]"
    assert done and len(tokens) == 64, "the in-flight request should run to its end"
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health", timeout=5)
