"""`qnext serve --nnodes 2` on the loopback (qnext/server/multinode.py): two processes of two XLA host devices each,
one engine tensor parallel over the four, rank 0 serving HTTP.

- /health and /metrics count the ranks; chat, streamed chat and a forced tool call through the openai client equal
  one process serving the same checkpoint (greedy, the real Qwen3.5 tokenizer);
- the follower killed mid-request: the running request and every later one get 503 naming the lost rank within
  BOUND_S seconds, and /health and /metrics count one rank up;
- a rank that never joins: 503 with the reason once --dist-timeout has passed, no hang;
- a rank started with another checkpoint: refused at its handshake (exit 2, both digests named), rank 0 says why;
- SIGTERM on rank 0 stops both ranks (exit 0).
Processes: one pair for the module (the kill ends it), one lone rank 0, one idle pair for SIGTERM; every wait is
bounded and every process stopped however a test ends. Prefix caching is off: fewer step shapes to compile."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from qnext.server.launch import running_ranks, ServerProcess, free_port_pair
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from tests.support.openai_answers import GREEDY, answers as openai_answers

MODEL = "tiny"
OPTIONS = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16",
           "--no-enable-prefix-caching"]
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
START_S = 300          # load + first start of two processes on a shared 2-core machine
BOUND_S = 10           # a lost rank turns into 503s within this
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ranks") / "ckpt", "qwen3_5", seed=1, tokenizer="qwen3.5",
                                 max_position_embeddings=512)


def serve_args(checkpoint, *extra) -> list[str]:
    return [str(checkpoint), "--served-model-name", MODEL, *OPTIONS, "--no-warm-up", "--log-level", "warning", *extra]


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory):
    with running_ranks(serve_args(checkpoint), 2, timeout=START_S, log_dir=tmp_path_factory.mktemp("logs"),
                       env=ENV) as procs:
        yield procs


@pytest.fixture(scope="module")
def one_process(checkpoint):
    """The same checkpoint served by one process on one device (in this process)."""
    import qnext
    from qnext.server.app import build_app
    from qnext.testing.inprocess_server import serve_in_thread

    llm = qnext.LLM(str(checkpoint), max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                    enable_prefix_caching=False)
    with serve_in_thread(build_app(llm.engine, model_name=MODEL)) as base_url:
        yield base_url


def answers(base_url: str) -> dict:
    return openai_answers(base_url, MODEL, MESSAGES)


def test_health_and_metrics_count_the_ranks(ranks):
    health = httpx.get(ranks[0].base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["ranks_up"] == 2 and health.json()["nnodes"] == 2
    metrics = httpx.get(ranks[0].base_url + "/metrics", timeout=10).text
    assert "qnext:ranks_up 2.0" in metrics and "qnext:ranks_total 2.0" in metrics


def test_chat_streaming_and_tools_equal_one_process(ranks, one_process):
    expected, served = answers(one_process), answers(ranks[0].base_url)
    assert expected["usage"] == 12 and expected["chat"] and expected["tool_calls"], expected
    assert served == expected
    assert expected["streamed"] == expected["chat"]


def test_a_rank_that_never_joins_gives_503_with_the_reason(checkpoint, tmp_path):
    address = f"127.0.0.1:{free_port_pair()}"
    rank0 = ServerProcess(serve_args(checkpoint, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", address,
                                     "--dist-timeout", "3"), log_path=tmp_path / "rank0.log", env=ENV)
    try:
        body = wait_for_503(rank0.base_url, "did not join", timeout=90)
        assert body["ranks_up"] == 1 and "rank 1 of 2 did not join within 3 s" in body["message"]
        refused = httpx.post(rank0.base_url + "/v1/chat/completions", timeout=10,
                             json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
        assert refused.status_code == 503 and "did not join" in refused.json()["error"]["message"]
    finally:
        assert rank0.stop(timeout=30) == 0, rank0.log_tail()


def test_a_rank_with_another_checkpoint_is_refused_at_start(checkpoint, tmp_path):
    other = write_tiny_checkpoint(tmp_path / "other", "qwen3_5", seed=2, tokenizer="qwen3.5",
                                  max_position_embeddings=512)
    address = f"127.0.0.1:{free_port_pair()}"
    rank0 = ServerProcess(serve_args(checkpoint, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", address,
                                     "--dist-timeout", "120"), log_path=tmp_path / "rank0.log", env=ENV)
    rank1 = ServerProcess(serve_args(other, "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", address,
                                     "--dist-timeout", "120"), log_path=tmp_path / "rank1.log", env=ENV)
    try:
        assert rank1.proc.wait(timeout=120) == 2, rank1.log_tail()
        assert "rank 1 loaded a different checkpoint: its identity is " in rank1.log_tail()
        assert "rank 0's is " in rank1.log_tail()
        body = wait_for_503(rank0.base_url, "different checkpoint", timeout=30)
        assert body["ranks_up"] == 1 and "waiting for rank 1" in body["message"]
    finally:
        rank1.stop(timeout=30)
        assert rank0.stop(timeout=30) == 0, rank0.log_tail()


def test_a_follower_killed_mid_request_gives_503s_within_the_bound(ranks):
    rank0, rank1 = ranks
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "temperature": 0, **GREEDY}
    result: dict = {}

    def long_request():
        result["response"] = httpx.post(rank0.base_url + "/v1/chat/completions", json=body, timeout=120)
        result["at"] = time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until_running(rank0.base_url, timeout=120)
    rank1.proc.kill()
    killed = time.monotonic()
    thread.join(timeout=BOUND_S + 5)
    assert not thread.is_alive(), "the running request hung after its follower died"
    assert result["response"].status_code == 503 and result["at"] - killed < BOUND_S
    assert "rank 1 of 2" in result["response"].json()["error"]["message"]
    late = httpx.post(rank0.base_url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=BOUND_S)
    assert late.status_code == 503 and "rank 1 of 2" in late.json()["error"]["message"]
    health = httpx.get(rank0.base_url + "/health", timeout=BOUND_S)
    assert health.status_code == 503 and health.json()["ranks_up"] == 1
    metrics = httpx.get(rank0.base_url + "/metrics", timeout=BOUND_S).text
    assert "qnext:ranks_up 1.0" in metrics
    assert rank0.stop(timeout=30) == 0, rank0.log_tail()


def test_sigterm_on_rank0_stops_every_rank(checkpoint, tmp_path):
    with running_ranks(serve_args(checkpoint), 2, timeout=START_S, log_dir=tmp_path, env=ENV) as procs:
        procs[0].terminate()
        for proc in procs:
            assert proc.proc.wait(timeout=60) == 0, proc.log_tail()


def wait_for_503(base_url: str, words: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(base_url + "/health", timeout=5)
            if r.status_code == 503 and words in r.json().get("message", ""):
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"/health never said {words!r} within {timeout} s")


def wait_until_running(base_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(base_url + "/health", timeout=5).json().get("num_requests_running", 0) > 0:
            time.sleep(1.0)            # a few decode steps in
            return
        time.sleep(0.2)
    raise TimeoutError("the request never started running")
