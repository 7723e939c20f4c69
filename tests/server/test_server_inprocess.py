"""The server in-process (uvicorn in a thread on a free loopback port) over an engine the test controls: greedy
text over HTTP equals LLM.generate on the same engine, an exception inside engine.step() fails the running
requests with 500 while the server keeps serving, and a full waiting queue answers 503 with Retry-After."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

import qnext
from qnext.served_engine import ForwardingEngine
from qnext.server.app import build_app
from qnext.testing.inprocess_server import serve_in_thread
from qnext.testing.tiny_checkpoint import demo_checkpoint_dir

MODEL = "tiny"
ENGINE_OPTIONS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)
PROMPTS = ["The keeper of the lighthouse", "Ships at sea in a storm, and the light that guides them home"]
CHAT = [{"role": "system", "content": "You answer in short sentences about the weather at sea."},
        {"role": "user", "content": "Will it rain tonight?"}]
MAX_TOKENS = 10


class ControlledEngine(ForwardingEngine):
    """An LLMEngine whose step() can be held (gate cleared) or made to raise once (fail_next_step)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next_step = False

    def step(self):
        if not self.gate.wait(timeout=60):
            raise RuntimeError("the test never reopened the gate")
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        return self.inner.step()


@pytest.fixture(scope="module")
def served():
    llm = qnext.LLM(demo_checkpoint_dir(), warm_up=True, **ENGINE_OPTIONS)
    params = qnext.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = {"prompts": [o.outputs[0].text for o in llm.generate(PROMPTS, params)],
                 "chat": llm.chat(CHAT, params)[0].outputs[0].text}
    engine = ControlledEngine(llm.engine)
    app = build_app(engine, model_name=MODEL, max_waiting_requests=2)
    with serve_in_thread(app) as base_url:
        try:
            yield base_url, engine, reference
        finally:
            engine.gate.set()      # a held step must not keep the server from stopping


def test_greedy_over_http_equals_llm_generate(served):
    base_url, _, reference = served
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=60, max_retries=0) as client:
        texts = [client.completions.create(model=MODEL, prompt=p, **greedy).choices[0].text for p in PROMPTS]
        assert texts == reference["prompts"]
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, **greedy)
        assert chat.choices[0].message.content == reference["chat"]
        streamed = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **greedy)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reference["chat"]


def _idle(engine) -> bool:
    snap = engine.status()
    return snap.num_running == 0 and snap.num_waiting == 0 and not engine.has_unfinished_requests()


def test_step_exception_fails_running_requests_with_500_and_serving_goes_on(served):
    base_url, engine, reference = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True, "temperature": 0.0}
    statuses = {}

    def non_streamed():
        statuses["plain"] = httpx.post(base_url + "/v1/completions", json=body, timeout=60)

    with httpx.Client(base_url=base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text"' in first
            worker = threading.Thread(target=non_streamed)
            worker.start()
            deadline = time.monotonic() + 30
            while engine.status().num_running < 2:                 # both running before the failure
                assert time.monotonic() < deadline
                time.sleep(0.01)
            engine.fail_next_step = True
            rest = [line for line in lines if line.startswith("data: ")]
        worker.join(60)
    assert rest and '"engine_step_failed"' in rest[-1] and "injected step failure" in rest[-1]
    assert "[DONE]" not in rest[-1]
    assert statuses["plain"].status_code == 500
    assert statuses["plain"].json()["error"]["code"] == "engine_step_failed"
    assert _idle(engine), "the failed requests must be aborted in the engine"
    assert "qnext:kv_cache_usage_perc{model_name=\"tiny\"} 0.0" in httpx.get(base_url + "/metrics").text
    ok = httpx.post(base_url + "/v1/completions", json={**body, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == reference["prompts"][1]


def test_full_waiting_queue_answers_503_with_retry_after(served):
    base_url, engine, _ = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0}
    answers = []
    engine.gate.clear()                  # the engine thread will hold in its next step
    try:
        workers = [threading.Thread(target=lambda: answers.append(
            httpx.post(base_url + "/v1/completions", json=body, timeout=60))) for _ in range(2)]
        for w in workers:
            w.start()
            time.sleep(0.3)              # in order: the first is taken into the held step, the second queues
        rejected = httpx.post(base_url + "/v1/completions", json=body, timeout=10)
        assert rejected.status_code == 503
        assert rejected.headers["retry-after"] == "1"
        assert "max_waiting_requests is 2" in rejected.json()["error"]["message"]
    finally:
        engine.gate.set()
    for w in workers:
        w.join(60)
    assert [a.status_code for a in answers] == [200, 200]
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200


def test_the_readmes_picture_example_runs_as_written_against_the_demo(served):
    """The README's image request (docs/vision.md, "The README's picture"; the demo checkpoint has the tiny tower):
    the picture's 48 pads are counted, and the second request is served from the prefix cache."""
    import contextlib
    import io
    import re
    from pathlib import Path

    base_url, _, _ = served
    doc = (Path(__file__).resolve().parents[2] / "docs" / "vision.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "image_url" in b)
    code = snippet.replace("http://127.0.0.1:8000/v1", base_url + "/v1").replace('"qnext-tiny-demo"', repr(MODEL))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/vision.md", "exec"), {})
    # each print starts a line with the two counts; the sampled reply that follows may hold newlines of its own
    usage = re.findall(r"^(\d+) (\d+) ", out.getvalue(), flags=re.M)
    assert usage == [("68", "0"), ("68", "64")], out.getvalue()
