"""`qnext pd-router` in front of servers that are down or that record what reaches them (stub peers on 127.0.0.1,
no model): a server that refuses connections is a 503 naming it, and the client's cluster-secret header never
passes the router."""
from __future__ import annotations

import socket

from fastapi.testclient import TestClient

from qnext.server.pd_router import build_pd_router
from tests.support.stub_http import StubServer

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def closed_port_url() -> str:
    """A 127.0.0.1 URL nothing listens on (a port just bound and closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_server_that_is_down_is_a_503_naming_it():
    down = closed_port_url()
    stub = StubServer(lambda *request: (200, {"choices": [{"finish_reason": "prefilled"}]}))
    with stub.running():
        with TestClient(build_pd_router(down, stub.url)) as router:
            reply = router.post("/v1/chat/completions", json=BODY)
            assert reply.status_code == 503, reply.text
            assert f"the prefill server {down} cannot be reached" in reply.json()["error"]["message"]
            assert reply.headers["retry-after"] == "1"
        with TestClient(build_pd_router(stub.url, down)) as router:
            reply = router.post("/v1/chat/completions", json=BODY)
            assert reply.status_code == 503 and f"the decode server {down}" in reply.text, reply.text
            assert router.get("/v1/models").status_code == 503


def test_the_router_passes_no_cluster_secret_of_the_client_on():
    stub = StubServer(lambda method, path, headers, body: (200, {"choices": [{"finish_reason": "prefilled"}]}))
    with stub.running(), TestClient(build_pd_router(stub.url, stub.url)) as router:
        router.post("/v1/chat/completions", json=BODY,
                    headers={"x-qnext-cluster-key": "guessed", "authorization": "Bearer k", "x-qnext-pd": "{}"})
    assert [method for method, _, _ in stub.requests] == ["POST", "POST"]      # to the prefill, then the decode side
    for _, _, headers in stub.requests:
        assert "x-qnext-cluster-key" not in headers and headers["authorization"] == "Bearer k"
        assert headers.get("x-qnext-pd", "{}") != "{}"                          # the router's own, not the client's
