"""Prefill/decode disaggregation over processes on loopback (docs/scale.md): `qnext serve --pd-role prefill`,
`qnext serve --pd-role decode` and `qnext pd-router` give the openai client what one process gives (chat, the chat
streamed, a forced tool call), with the prompt computed by the prefill server and its KV and state pulled through
JAX's transfer server; the decode server reports the whole prompt cached; the prefill server's bundle routes; a
decode request whose bundle is gone is computed on the decode server."""
from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from qnext.server.launch import ServerProcess
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from tests.support.openai_answers import GREEDY, answers

MODEL = "tiny"
OPTIONS = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16"]
ENV = {"JAX_PLATFORMS": "cpu"}
START_S = 300
MESSAGES = [{"role": "system", "content": "You answer briefly, in one short sentence about the sea and the sky."},
            {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("pd") / "ckpt", "qwen3_5", seed=1, tokenizer="qwen3.5",
                                 max_position_embeddings=512)


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_logs")
    with contextlib.ExitStack() as stack:
        started = {}
        for role in ("prefill", "decode"):
            source = ["--pd-prefill-url", started["prefill"].base_url] if role == "decode" else []
            proc = ServerProcess([str(checkpoint), "--served-model-name", MODEL, *OPTIONS, "--no-warm-up",
                                  "--log-level", "warning", "--pd-role", role, *source], log_path=logs / f"{role}.log",
                                 env=ENV)
            stack.callback(proc.stop)
            started[role] = proc
        for proc in started.values():
            proc.wait_healthy(START_S)
        router = ServerProcess(["pd-router", "--prefill", started["prefill"].base_url, "--decode",
                                started["decode"].base_url, "--log-level", "warning"], log_path=logs / "router.log",
                               env=ENV)
        stack.callback(router.stop)
        router.wait_healthy(60)
        yield {**started, "router": router}


@pytest.fixture(scope="module")
def one_process(checkpoint):
    import qnext
    from qnext.server.app import build_app
    from qnext.testing.inprocess_server import serve_in_thread

    llm = qnext.LLM(str(checkpoint), max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
    with serve_in_thread(build_app(llm.engine, model_name=MODEL)) as base_url:
        yield base_url


def metric(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in {base_url}/metrics")


def test_router_over_prefill_and_decode_equals_one_process(servers, one_process):
    expected = answers(one_process, MODEL, MESSAGES)
    served = answers(servers["router"].base_url, MODEL, MESSAGES)
    assert expected["usage"] == 12 and expected["chat"] and expected["tool_calls"], expected
    for key in ("chat", "usage", "streamed", "tool_calls"):
        assert served[key] == expected[key], key
    # the decode server computed none of the prompt: every token came from the prefill server or its own cache
    assert served["cached_tokens"] == served["prompt_tokens"]
    assert metric(servers["prefill"].base_url, "qnext:request_success_total") >= 3


def test_the_prefill_server_answers_prefilled_and_offers_its_bundle_once(servers):
    rid = "pd-test-bundle"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, **GREEDY}
    answer = httpx.post(servers["prefill"].base_url + "/v1/chat/completions", json=body, timeout=60,
                        headers={"x-qnext-pd": json.dumps({"request_id": rid})}).json()
    assert answer["choices"][0]["finish_reason"] == "prefilled" and answer["usage"]["completion_tokens"] == 1
    meta = httpx.get(f"{servers['prefill'].base_url}/pd/bundles/{rid}", timeout=10).json()
    assert meta["finish_reason"] == "prefilled" and meta["num_blocks"] == -(-len(meta["prompt_token_ids"]) // 16)
    pull = httpx.post(f"{servers['prefill'].base_url}/pd/bundles/{rid}/pull", timeout=10,
                      json={"first_block": meta["num_blocks"], "num_kv_layers": 1})
    assert pull.status_code == 200 and {name.split(".")[0] for name, _, _ in pull.json()["arrays"]} == {
        "conv", "recurrent"}                      # every block held: only the state is offered
    again = httpx.get(f"{servers['prefill'].base_url}/pd/bundles/{rid}", timeout=10)
    assert again.status_code == 404 and "already pulled" in again.text
    bad = httpx.post(servers["decode"].base_url + "/v1/chat/completions", json=body, timeout=60,
                     headers={"x-qnext-pd": "not json"})
    assert bad.status_code == 400 and "x-qnext-pd" in bad.text
    # a bundle that is gone (pulled above): the decode server computes the prompt itself
    gone = {"request_id": "pd-test-gone", "prefill_url": servers["prefill"].base_url, "prefill_request_id": rid}
    local = httpx.post(servers["decode"].base_url + "/v1/chat/completions", json=body, timeout=60,
                       headers={"x-qnext-pd": json.dumps(gone)}).json()
    assert local["usage"]["completion_tokens"] == 5 and local["choices"][0]["finish_reason"] == "length"


def test_the_decode_server_fetches_only_from_its_prefill_urls(servers):
    """The x-qnext-pd header can come from any client: one naming an address outside --pd-prefill-url is a 400
    and the decode server never connects there; the prefill server, which fetches from nobody, refuses one too."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    connections, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connections.append(listener.accept()[0])
            except OSError:
                continue

    watcher = threading.Thread(target=accept)
    watcher.start()
    elsewhere = f"http://127.0.0.1:{listener.getsockname()[1]}"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    try:
        for server in ("decode", "prefill"):
            source = {"request_id": f"pd-elsewhere-{server}", "prefill_url": elsewhere, "prefill_request_id": "x"}
            reply = httpx.post(servers[server].base_url + "/v1/chat/completions", json=body, timeout=60,
                               headers={"x-qnext-pd": json.dumps(source)})
            assert reply.status_code == 400, reply.text
            message = reply.json()["error"]["message"]
            assert elsewhere in message and "--pd-prefill-url" in message, message
        assert servers["prefill"].base_url in message or "not a decode server" in message
    finally:
        stop.set()
        watcher.join(5)
        listener.close()
    assert connections == []
