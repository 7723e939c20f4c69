"""LoRA adapters through the server, driven by the official openai client: `model` picks an adapter on every API,
/v1/models lists them, adapters are loaded and unloaded at run time behind the API key, unknown names are 404s.
One engine for the module: its LLM.generate answers are taken first (the oracle), then the same engine is served."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import httpx
import numpy as np
import openai
import pytest

import qnext
from qnext.server.app import build_app
from qnext.server.lora_adapters import ServedAdapters, install_lora_routes, parse_lora_modules
from qnext.testing.inprocess_server import serve_in_thread
from qnext.testing.tiny_adapter import write_tiny_adapter

BASE = "tiny-base"
KEY = "secret-key"
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 500, 24)]
GREEDY = qnext.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("qwen3_5")
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: str(write_tiny_adapter(root / name, ckpt, seed=i)) for i, name in enumerate(("a0", "a1"))}
    paths["rank8"] = str(write_tiny_adapter(root / "rank8", ckpt, rank=8))
    llm = qnext.LLM(ckpt, enable_lora=True, max_loras=2, max_lora_rank=4, max_num_seqs=4,
                    max_num_batched_tokens=64, max_model_len=256)
    expected = {name: list(llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, lora_request=lora)[0]
                           .outputs[0].token_ids)
                for name, lora in (("base", None), ("a0", qnext.LoRARequest("a0", 7, paths["a0"])),
                                   ("a1", qnext.LoRARequest("a1", 8, paths["a1"])))}
    adapters = ServedAdapters(llm.engine, (BASE,))
    for name, path in parse_lora_modules([f"a0={paths['a0']}"]):
        adapters.load(name, path)
    app = build_app(llm.engine, model_name=BASE, api_key=KEY, adapters=adapters)
    with serve_in_thread(app) as url:
        yield types.SimpleNamespace(url=url, paths=paths, expected=expected, checkpoint=str(ckpt))


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, timeout=120, max_retries=0) as c:
        yield c


def _completion_tokens(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.model == model
    return out.choices[0].model_extra["token_ids"]


def _admin(served, route, body, key=KEY):
    return httpx.post(served.url + route, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"} if key else {})


def test_model_picks_the_adapter_and_equals_llm_generate(served, client):
    assert _completion_tokens(client, "a0") == served.expected["a0"]
    assert _completion_tokens(client, BASE) == served.expected["base"]
    assert served.expected["a0"] != served.expected["base"]


def test_every_api_serves_the_adapter(served, client):
    def chat(model):
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                             max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        assert out.model == model
        return out.choices[0].message.content

    def responses(model):
        return client.responses.create(model=model, input="hello there", max_output_tokens=8, temperature=0.0,
                                       extra_body={"ignore_eos": True}).output_text

    def messages(model):
        r = httpx.post(served.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
            "model": model, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        return json.dumps(r.json()["content"])

    for api in (chat, responses, messages):
        assert api("a0") != api(BASE), api.__name__


def test_models_lists_the_adapters_with_their_parent(served, client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "a0"}
    assert cards["a0"].model_extra["parent"] == BASE and cards["a0"].model_extra["root"] == served.paths["a0"]


def test_load_use_unload_at_run_time(served, client):
    r = _admin(served, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": served.paths["a1"]})
    assert r.status_code == 200, r.text
    assert "a1" in {m.id for m in client.models.list().data}
    assert _completion_tokens(client, "a1") == served.expected["a1"]
    assert _admin(served, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": served.paths["a1"]}
                  ).status_code == 400                      # already loaded
    assert _admin(served, "/v1/unload_lora_adapter", {"lora_name": "a1"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        _completion_tokens(client, "a1")
    assert e.value.body["code"] == "model_not_found" and "'a1'" in e.value.body["message"]
    r = _admin(served, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


def test_unknown_adapter_is_404_on_every_api(served, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'a0'" in e.value.body["message"]
    r = httpx.post(served.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error"


def test_bad_adapters_are_400s_naming_what_was_wrong(served, tmp_path):
    r = _admin(served, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "adapter_config.json is missing" in r.json()["error"]["message"]
    r = _admin(served, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": served.paths["rank8"]})
    assert r.status_code == 400 and "above max_lora_rank 4" in r.json()["error"]["message"]
    r = _admin(served, "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": served.paths["a1"]})
    assert r.status_code == 400 and "base model's name" in r.json()["error"]["message"]
    r = _admin(served, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and "'lora_path'" in r.json()["error"]["message"]
    assert _admin(served, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": served.paths["a1"]},
                  key=None).status_code == 401


def test_runtime_updates_need_an_api_key():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from qnext.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)
    install_lora_routes(app, ServedAdapters(types.SimpleNamespace(), (BASE,)), api_key=None)
    r = TestClient(app).post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]


def test_lora_modules_flag_values(served, tmp_path):
    assert parse_lora_modules(["a=/x/y", '{"name": "b", "path": "/z"}']) == [("a", "/x/y"), ("b", "/z")]
    for bad in (["a"], ["=/x"], ['{"name": "b"}'], ["{nope"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "qnext.server", served.checkpoint, "--no-warm-up", *args],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})

    run = serve("--lora-modules", "a=/x")
    assert run.returncode == 2 and "--lora-modules needs --enable-lora" in run.stderr
    run = serve("--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"a0={served.paths['a0']}",
                f"rank8={served.paths['rank8']}")          # the flags reach the catalog: the second one is refused
    assert run.returncode == 2 and "cannot load LoRA adapter 'rank8'" in run.stderr
    assert "above max_lora_rank 4" in run.stderr
