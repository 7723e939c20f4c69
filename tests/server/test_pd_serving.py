"""Prefill/decode disaggregation over processes on loopback (docs/pd.md): `qnext serve --pd-role prefill`,
`qnext serve --pd-role decode` and `qnext pd-router` give the openai client what one process gives (chat, the chat
streamed, a forced tool call), with the prompt computed by the prefill server and its KV and state pulled through
JAX's transfer server; the decode server reports the whole prompt cached; the prefill server's bundle routes,
behind the cluster secret; a decode request whose bundle is gone is computed on the decode server. Against bad
requests and bad peers (a stub peer on 127.0.0.1 that is slow or lies): each fails alone with a clear status while
another stream decodes on."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from qnext.server.launch import ServerProcess
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from tests.support.openai_answers import GREEDY, answers
from tests.support.stub_http import StubServer

MODEL = "tiny"
OPTIONS = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16"]
SECRET = "pd-test-cluster-secret-0123456789"
ENV = {"JAX_PLATFORMS": "cpu", "QNEXT_CLUSTER_SECRET": SECRET}
KEY = {"x-qnext-cluster-key": SECRET}
PD_TIMEOUT_S = 3              # the decode server's --pd-timeout
SLOW_S = 20                   # how long the stub peer sleeps before it answers a "slow-" bundle
START_S = 300
MESSAGES = [{"role": "system", "content": "You answer briefly, in one short sentence about the sea and the sky."},
            {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("pd") / "ckpt", "qwen3_5", seed=1, tokenizer="qwen3.5",
                                 max_position_embeddings=512)


def stub_peer(prefill_url: str) -> StubServer:
    """A prefill server that lies or dawdles, by the bundle id's prefix: "slow-" sleeps SLOW_S seconds; "liar-X"
    serves bundle X's metadata with another model identity; "short-X" serves X's metadata truly, then offers its
    arrays one block short (it asks the real prefill server for one block fewer)."""
    def respond(method, path, headers, body):
        rid = path.split("/")[3]
        kind, _, real = rid.partition("-")
        if kind == "slow":
            time.sleep(SLOW_S)
            return 404, {}
        real_path = f"{prefill_url}/pd/bundles/{real}"
        if method == "GET":
            meta = httpx.get(real_path, headers=KEY, timeout=10).json()
            return 200, {**meta, "model_identity": "0" * 32} if kind == "liar" else meta
        ask = json.loads(body)
        answer = httpx.post(real_path + "/pull", json={**ask, "first_block": ask["first_block"] + 1}, headers=KEY,
                            timeout=10)
        return answer.status_code, answer.json()
    return StubServer(respond)


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_logs")
    with contextlib.ExitStack() as stack:
        started = {}
        for role in ("prefill", "decode"):
            if role == "decode":
                started["stub"] = stack.enter_context(stub_peer(started["prefill"].base_url).running())
                source = ["--pd-prefill-url", started["prefill"].base_url, "--pd-prefill-url", started["stub"].url,
                          "--pd-timeout", str(PD_TIMEOUT_S)]
            else:
                source = []
            proc = ServerProcess([str(checkpoint), "--served-model-name", MODEL, *OPTIONS, "--no-warm-up",
                                  "--log-level", "warning", "--pd-role", role, *source], log_path=logs / f"{role}.log",
                                 env=ENV)
            stack.callback(proc.stop)
            started[role] = proc
        for role in ("prefill", "decode"):
            started[role].wait_healthy(START_S)
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


def prefill(servers, rid: str, max_tokens: int = 5) -> None:
    """Runs the prompt of MESSAGES on the prefill server as bundle `rid`, as the router would."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **GREEDY}
    answer = httpx.post(servers["prefill"].base_url + "/v1/chat/completions", json=body, timeout=60,
                        headers={"x-qnext-pd": json.dumps({"request_id": rid})}).json()
    assert answer["choices"][0]["finish_reason"] == "prefilled" and answer["usage"]["completion_tokens"] == 1


def decode(servers, source: dict | None, max_tokens: int = 5, timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **GREEDY}
    headers = {} if source is None else {"x-qnext-pd": json.dumps(source)}
    return httpx.post(servers["decode"].base_url + "/v1/chat/completions", json=body, timeout=timeout,
                      headers=headers)


def test_the_prefill_server_answers_prefilled_and_offers_its_bundle_once(servers):
    rid = "pd-test-bundle"
    prefill(servers, rid)
    url = f"{servers['prefill'].base_url}/pd/bundles/{rid}"
    # /pd/* wants the cluster secret: none is a 401, another one a 403 (and the bundle stays)
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, timeout=10, headers={"x-qnext-cluster-key": "x" * len(SECRET)}).status_code == 403
    assert httpx.post(url + "/pull", timeout=10, json={"first_block": 0, "num_kv_layers": 1}).status_code == 401
    meta = httpx.get(url, timeout=10, headers=KEY)
    assert meta.status_code == 200
    meta = meta.json()
    assert meta["finish_reason"] == "prefilled" and meta["num_blocks"] == -(-len(meta["prompt_token_ids"]) // 16)
    pull = httpx.post(url + "/pull", timeout=10, headers=KEY,
                      json={"first_block": meta["num_blocks"], "num_kv_layers": 1})
    assert pull.status_code == 200 and {name.split(".")[0] for name, _, _ in pull.json()["arrays"]} == {
        "conv", "recurrent"}                      # every block held: only the state is offered
    again = httpx.get(url, timeout=10, headers=KEY)
    assert again.status_code == 404 and "already pulled" in again.text
    bad = httpx.post(servers["decode"].base_url + "/v1/chat/completions", timeout=60,
                     headers={"x-qnext-pd": "not json"}, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert bad.status_code == 400 and "x-qnext-pd" in bad.text
    # without the router's header a prefill server serves the whole answer and keeps no bundle of it
    whole = httpx.post(servers["prefill"].base_url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, **GREEDY}).json()
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 5
    assert httpx.get(f"{servers['prefill'].base_url}/pd/bundles/{whole['id']}", headers=KEY).status_code == 404
    # a bundle that is gone (pulled above): the decode server computes the prompt itself
    gone = {"request_id": "pd-test-gone", "prefill_url": servers["prefill"].base_url, "prefill_request_id": rid}
    local = decode(servers, gone).json()
    assert local["usage"]["completion_tokens"] == 5 and local["choices"][0]["finish_reason"] == "length"


def test_the_decode_server_fetches_only_from_its_prefill_urls_and_ids_it_can_trust(servers):
    """The x-qnext-pd header can come from any client: one naming an address outside --pd-prefill-url, or an id
    that is no plain name (`../../metrics` would reach another path of an allowed server), is a 400 and the decode
    server connects nowhere; the prefill server, which fetches from nobody, refuses a prefill_url too."""
    stub = servers["stub"]
    seen = len(stub.requests)
    for server, source in [
            ("decode", {"request_id": "pd-elsewhere", "prefill_url": "http://127.0.0.1:9", "prefill_request_id": "x"}),
            ("prefill", {"request_id": "pd-elsewhere", "prefill_url": stub.url, "prefill_request_id": "x"}),
            ("decode", {"request_id": "pd-dots", "prefill_url": stub.url, "prefill_request_id": "../../metrics"}),
            ("decode", {"request_id": "pd-dots", "prefill_url": stub.url, "prefill_request_id": "a/b"}),
            ("decode", {"request_id": "../x", "prefill_url": stub.url, "prefill_request_id": "x"})]:
        reply = httpx.post(servers[server].base_url + "/v1/chat/completions", timeout=60,
                           json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                           headers={"x-qnext-pd": json.dumps(source)})
        assert reply.status_code == 400, reply.text
        message = reply.json()["error"]["message"]
        assert "--pd-prefill-url" in message or "letters, digits" in message, message
    assert len(stub.requests) == seen


class Stream:
    """A streamed plain chat on the decode server, read on a thread: its tokens' arrival times and its end."""

    def __init__(self, servers, max_tokens: int):
        self.times, self.finish, self.error = [], None, None
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, **GREEDY}
        self.thread = threading.Thread(target=self._read, args=(servers["decode"].base_url, body))
        self.thread.start()

    def _read(self, base_url, body):
        try:
            with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = chunk["error"]
                        elif chunk["choices"]:
                            self.times.append(time.monotonic())
                            self.finish = chunk["choices"][0]["finish_reason"] or self.finish
        except Exception as e:      # noqa: BLE001 (reported by the test's asserts)
            self.error = repr(e)

    def wait_started(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < 3 and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def join(self) -> None:
        self.thread.join(90)
        assert not self.thread.is_alive() and self.error is None and self.finish == "length", (self.error,
                                                                                               self.finish)


def test_a_request_the_first_token_ends_on_the_decode_server_fails_alone_with_a_400(servers):
    """x-qnext-pd sent straight to the decode server with max_tokens 1 (the prefill server ran it with 5): the
    request gets a 400 saying why, and the stream decoding beside it ends normally."""
    prefill(servers, "pd-ends-here")
    stream = Stream(servers, 120)
    stream.wait_started()
    source = {"request_id": "pd-ends-here-d", "prefill_url": servers["prefill"].base_url,
              "prefill_request_id": "pd-ends-here"}
    reply = decode(servers, source, max_tokens=1, timeout=30)
    assert reply.status_code == 400 and "the first token ends this request here" in reply.text, reply.text
    stream.join()


def test_a_slow_prefill_server_fails_its_request_after_the_deadline_while_others_decode(servers):
    stream = Stream(servers, 480)
    stream.wait_started()
    t0 = time.monotonic()
    reply = decode(servers, {"request_id": "pd-slow", "prefill_url": servers["stub"].url,
                             "prefill_request_id": "slow-x"}, timeout=SLOW_S + 30)
    waited = time.monotonic() - t0
    assert reply.status_code == 504 and "--pd-timeout" in reply.text, reply.text
    assert PD_TIMEOUT_S <= waited < SLOW_S, waited
    stream.join()
    during = [t0] + [t for t in stream.times if t0 < t < t0 + waited]      # decoding went on meanwhile
    assert len(during) > 10 and max(b - a for a, b in zip(during, during[1:])) < 1.0, during


def test_a_lying_prefill_server_fails_its_request_alone_with_a_502(servers):
    """A peer serving another model's bundle (same shapes: a fine-tune), and one offering arrays a block short:
    each request fails with a 502 saying so, before anything touches the cache; the decode server serves on."""
    stream = Stream(servers, 120)
    stream.wait_started()
    for kind, said in (("liar", "computes another model"), ("short", "not what bundle")):
        prefill(servers, f"pd-{kind}")
        reply = decode(servers, {"request_id": f"pd-{kind}-d", "prefill_url": servers["stub"].url,
                                 "prefill_request_id": f"{kind}-pd-{kind}"}, timeout=30)
        assert reply.status_code == 502 and said in reply.text, reply.text
    stream.join()
    assert decode(servers, None).json()["choices"][0]["finish_reason"] == "length"
