"""`qnext serve --data-parallel-size 2` with a process per replica (qnext/server/replica_process.py): both replicas
answer (cache-aware routing sends a chat's next turn back to its replica and it is served from that cache); a
picture is preprocessed in the HTTP process and encoded by a replica, whose cache keys on it; one
replica killed mid-request: the request it held fails with a 503 naming it, /health says 1 of 2 replicas are up, and
every later request is answered by the other. One server process (and its two replicas) for the module."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from qnext.server.launch import running_server
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from tests.support.vision_checkpoint import data_url, picture

MODEL = "tiny"
ARGS = ["--served-model-name", MODEL, "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens",
        "64", "--block-size", "16", "--no-warm-up", "--log-level", "warning", "--data-parallel-size", "2"]
SYSTEM = "You are a terse assistant who answers questions about the weather at sea in one short sentence."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_processes")
    checkpoint = write_tiny_checkpoint(tmp / "ckpt", "qwen3_5", seed=2, tokenizer="qwen3.5", vlm=True,
                                       max_position_embeddings=512)
    with running_server([str(checkpoint), *ARGS], timeout=300, log_path=tmp / "server.log",
                        env={"JAX_PLATFORMS": "cpu"}) as proc:
        yield proc


def chat(base_url: str, question: str | list, max_tokens: int = 6, history: list | None = None,
         system: bool = True) -> httpx.Response:
    """A chat; without `system` its first KV block is the question's own (no prefix shared with other requests)."""
    messages = [*([{"role": "system", "content": SYSTEM}] if system else []), *(history or []),
                {"role": "user", "content": question}]
    return httpx.post(base_url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})


def wait_for_in_flight(base_url: str, per_replica: list[int], timeout: float = 60, key: str = "in_flight",
                      any_order: bool = False) -> None:
    """Until each replica holds these many requests sent (key="admitted": and taken) and not yet finished, as the
    router sees them (any_order: whichever replica holds which count)."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = httpx.get(base_url + "/health", timeout=10).json()["replicas"]
        held = [r[key] for r in replicas]
        if held == per_replica or (any_order and sorted(held) == sorted(per_replica)):
            return
        assert time.monotonic() < deadline, f"the replicas never held {per_replica} requests: {replicas}"
        time.sleep(0.05)


def served_by(base_url: str) -> dict[str, float]:
    """Finished requests per replica (engine label), from /metrics."""
    counts: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("qnext:request_success_total{"):
            engine = line.split('engine="')[1].split('"')[0]
            counts[engine] = counts.get(engine, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_replicas_are_processes_and_both_answer(server):
    health = httpx.get(server.base_url + "/health", timeout=10).json()
    pids = [r["pid"] for r in health["replicas"]]
    assert health["replicas_up"] == 2 and len(set(pids)) == 2 and server.proc.pid not in pids
    first = chat(server.base_url, "Will it rain tonight?")
    assert first.status_code == 200
    answer = first.json()["choices"][0]["message"]["content"]
    second_turn = chat(server.base_url, "And tomorrow?", history=[{"role": "user", "content": "Will it rain tonight?"},
                                                                  {"role": "assistant", "content": answer}])
    assert second_turn.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # routed back to its cache
    results = [None, None]

    def ask(i):   # the first runs long enough that the second arrives while it runs, however loaded the machine
        results[i] = chat(server.base_url, f"Question {i}: is the sea rough near island {i * 7}?",
                          max_tokens=96 if i == 0 else 24, system=False)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    threads[0].start()                # no prefix anywhere: the replica chosen least recently takes it
    wait_for_in_flight(server.base_url, [1, 0], any_order=True)
    threads[1].start()                # arrives while the first runs: the less loaded replica takes it
    for t in threads:
        t.join(120)
    assert [r.status_code for r in results] == [200, 200]
    assert set(served_by(server.base_url)) == {"0", "1"}


def test_a_replica_process_reads_pictures_and_keys_its_cache_on_them(server):
    """The HTTP process preprocesses, the replica runs the tower: the same picture again is served from the
    replica's cache, another picture with the same text reuses nothing past the text before it."""
    def ask(seed: int) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": data_url(picture(seed))}},
                 {"type": "text", "text": "What do you see in this picture?"}]
        reply = chat(server.base_url, parts, system=False)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]

    first, again, other = ask(1), ask(1), ask(2)
    assert first["prompt_tokens"] == again["prompt_tokens"] == other["prompt_tokens"] > 16   # 16 pads
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == (first["prompt_tokens"] - 1) // 16 * 16
    assert other["prompt_tokens_details"]["cached_tokens"] == 0      # the picture starts in the first block


def test_a_killed_replica_is_taken_out_and_the_other_keeps_answering(server):
    import os
    import signal

    replicas = httpx.get(server.base_url + "/health", timeout=10).json()["replicas"]
    results: dict[int, httpx.Response] = {}

    def ask(i):
        results[i] = chat(server.base_url, f"A long answer {i} about tides and the moon, please.", max_tokens=300,
                          system=False)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    threads[0].start()
    wait_for_in_flight(server.base_url, [1, 0], any_order=True)
    threads[1].start()
    # one request taken by each replica, neither finished (300 tokens); one not yet taken would go to the other
    wait_for_in_flight(server.base_url, [1, 1], key="admitted")
    os.kill(replicas[1]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(120)
    statuses = sorted(r.status_code for r in results.values())
    assert statuses == [200, 503], statuses
    failed = next(r for r in results.values() if r.status_code == 503)
    assert "data parallel replica 1" in failed.json()["error"]["message"]
    health = httpx.get(server.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["replicas_up"] == 1
    assert [r["in_flight"] for r in health.json()["replicas"]] == [0, 0]
    later = [chat(server.base_url, f"After the loss, question {i}?") for i in range(3)]
    assert [r.status_code for r in later] == [200, 200, 200]
