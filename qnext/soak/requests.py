"""The soak's request mix: every kind a client sends, through the official openai and anthropic SDKs (or a raw
socket for a client that never reads), each ending in an Outcome (judge.py). Sizes stay small (the demo model on a
CPU): the load is in the count and the mix, not in the length."""
from __future__ import annotations

import base64
import io
import json
import random
import socket
import time
from dataclasses import dataclass

import httpx
from PIL import Image

from qnext.optional import optional_import
from qnext.soak.judge import Outcome

openai = anthropic = None      # the SDKs (the [soak] extra), imported when a RequestMix is made
REQUEST_DEADLINE_S = 120.0      # a request without an answer by then is "left hanging"
WORDS = ("sea ship light keeper storm night wind wave harbour rock coast bell fog boat sailor map star north south "
         "tide rope lamp tower island bird rain cloud morning evening story old new small great quiet").split()
SYSTEM = "You are a lighthouse keeper's assistant. " + " ".join(WORDS) * 2     # shared: a cached prefix
PROBES = ["Tell me about the harbour at night.", "Which bird sings in the fog?", "Count the ships: one, two,"]
TOOLS = [{"type": "function", "function": {"name": "get_tide", "description": "Tide times for a harbour",
                                           "parameters": {"type": "object", "required": ["harbour"], "properties": {
                                               "harbour": {"type": "string", "enum": ["Brest", "Oban", "Cork"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 3}}}}}]
ANSWER = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}}

# kind -> weight; "bad" is ~5% of requests
WEIGHTS = {"chat": 10, "chat_stream": 10, "chat_n2": 4, "tool_call": 5, "json_schema": 4, "picture": 4,
           "long_prompt": 3, "completion": 6, "messages": 6, "messages_stream": 6, "responses": 5,
           "responses_stream": 5, "probe": 6, "bad": 4, "disconnect": 3, "never_read": 1, "abort": 2}
ROUTED_BY_PD = {"chat", "chat_stream", "chat_n2", "tool_call", "json_schema", "long_prompt", "completion", "probe",
                "bad", "disconnect", "never_read", "abort"}


def picture_url(seed: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), ((seed * 37) % 256, (seed * 91) % 256, 40)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Target:
    base_url: str                # http://127.0.0.1:PORT
    model: str
    max_model_len: int


class RequestMix:
    """Sends one request of a given kind and says how it ended. Thread-safe: each call makes its own clients."""

    def __init__(self, target: Target, kinds: set[str], probe_answers: dict[str, str] | None = None):
        global openai, anthropic
        openai = optional_import("openai", "soak", "the soak's clients")
        anthropic = optional_import("anthropic", "soak", "the soak's clients")
        self.target, self.kinds = target, kinds
        self.probe_answers = probe_answers or {}
        self.t0 = time.monotonic()

    def warm(self, concurrency: int = 4) -> None:
        """Every kind `concurrency` times, `concurrency` at once, before what is measured: a (re)started server compiles or
        loads its step shapes and the tower's batch shapes on first use and grows its pools to their size (the
        picture path's first requests alone add ~0.9 GB of RSS on the demo), which is start-up, not growth."""
        import concurrent.futures

        kinds = sorted(self.kinds - {"never_read", "abort", "disconnect", "bad"})
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda i: self.send(kinds[i % len(kinds)], random.Random(i)),
                          range(concurrency * len(kinds))))

    def pick(self, rng: random.Random) -> str:
        names = [k for k in WEIGHTS if k in self.kinds]
        return rng.choices(names, [WEIGHTS[k] for k in names])[0]

    def send(self, kind: str, rng: random.Random) -> Outcome:
        start = time.monotonic() - self.t0
        expect = "client_error" if kind == "bad" else "any" if kind in ("disconnect", "never_read", "abort") else "ok"
        outcome = Outcome(kind, expect, 200, start, start)
        try:
            getattr(self, f"_{kind}")(rng, outcome)
        except (openai.APITimeoutError, anthropic.APITimeoutError, httpx.TimeoutException) as e:
            outcome.status, outcome.detail = "timeout", f"{type(e).__name__}"
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            outcome.status, outcome.detail = e.status_code, str(e)[:200]
        except (openai.APIConnectionError, anthropic.APIConnectionError, httpx.TransportError, OSError) as e:
            outcome.status, outcome.detail = "connection", f"{type(e).__name__}: {e}"[:200]
        outcome.end = time.monotonic() - self.t0
        return outcome

    # ---- clients -----------------------------------------------------------------------------------------------
    def openai(self, timeout: float = REQUEST_DEADLINE_S):
        return openai.OpenAI(base_url=self.target.base_url + "/v1", api_key="unused", timeout=timeout, max_retries=0)

    def anthropic(self):
        return anthropic.Anthropic(base_url=self.target.base_url, api_key="unused", timeout=REQUEST_DEADLINE_S,
                                   max_retries=0)

    def _messages_for(self, rng: random.Random) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": words(rng, rng.randint(3, 30))}]

    def _chat_kwargs(self, rng: random.Random) -> dict:
        return {"model": self.target.model, "messages": self._messages_for(rng), "max_tokens": rng.randint(4, 24),
                "temperature": 0.8, "seed": rng.randrange(1 << 30)}

    # ---- kinds (each fills the outcome or raises) --------------------------------------------------------------
    def _chat(self, rng, outcome):
        with self.openai() as client:
            reply = client.chat.completions.create(**self._chat_kwargs(rng))
        outcome.detail = reply.choices[0].finish_reason

    def _chat_stream(self, rng, outcome):
        with self.openai() as client, client.chat.completions.create(**self._chat_kwargs(rng), stream=True) as s:
            finish = [c.choices[0].finish_reason for c in s if c.choices and c.choices[0].finish_reason]
        if not finish:
            outcome.status, outcome.detail = "truncated", "the stream ended without a finish_reason"

    def _chat_n2(self, rng, outcome):
        with self.openai() as client:
            reply = client.chat.completions.create(**self._chat_kwargs(rng), n=2)
        if len(reply.choices) != 2:
            outcome.status, outcome.detail = "wrong", f"{len(reply.choices)} choices for n=2"

    def _tool_call(self, rng, outcome):
        with self.openai() as client:
            reply = client.chat.completions.create(**{**self._chat_kwargs(rng), "max_tokens": 64}, tools=TOOLS,
                                                   tool_choice="required", parallel_tool_calls=False)
        calls = reply.choices[0].message.tool_calls or []
        if reply.choices[0].finish_reason == "tool_calls" and not calls:
            outcome.status, outcome.detail = "wrong", "finish_reason tool_calls without a call"

    def _json_schema(self, rng, outcome):
        with self.openai() as client:
            reply = client.chat.completions.create(**{**self._chat_kwargs(rng), "max_tokens": 32}, response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
        if reply.choices[0].finish_reason == "stop":
            json.loads(reply.choices[0].message.content)        # a stop under a schema is valid JSON

    def _picture(self, rng, outcome):
        content = [{"type": "image_url", "image_url": {"url": picture_url(rng.randrange(8))}},
                   {"type": "text", "text": words(rng, 5)}]
        with self.openai() as client:
            client.chat.completions.create(model=self.target.model, max_tokens=8,
                                           messages=[{"role": "user", "content": content}])

    def _long_prompt(self, rng, outcome):
        with self.openai() as client:
            client.chat.completions.create(model=self.target.model, max_tokens=4, messages=[
                {"role": "user", "content": words(rng, self.target.max_model_len // 4)}])

    def _completion(self, rng, outcome):
        with self.openai() as client:
            client.completions.create(model=self.target.model, prompt=words(rng, 12), max_tokens=rng.randint(4, 16),
                                      temperature=0.7, seed=rng.randrange(1 << 30))

    def _messages(self, rng, outcome, stream: bool = False):
        kwargs = {"model": self.target.model, "max_tokens": rng.randint(4, 24), "system": SYSTEM,
                  "messages": [{"role": "user", "content": words(rng, rng.randint(3, 20))}]}
        with self.anthropic() as client:
            if stream:
                with client.messages.stream(**kwargs) as s:
                    for _ in s:
                        pass
                    s.get_final_message()
            else:
                client.messages.create(**kwargs)

    def _messages_stream(self, rng, outcome):
        self._messages(rng, outcome, stream=True)

    def _responses(self, rng, outcome, stream: bool = False):
        with self.openai() as client:
            kwargs = {"model": self.target.model, "instructions": SYSTEM, "input": words(rng, rng.randint(3, 20)),
                      "max_output_tokens": rng.randint(4, 24), "store": False}
            if stream:
                with client.responses.create(**kwargs, stream=True) as s:
                    for _ in s:
                        pass
            else:
                client.responses.create(**kwargs)

    def _responses_stream(self, rng, outcome):
        self._responses(rng, outcome, stream=True)

    def _probe(self, rng, outcome):
        prompt = rng.choice(PROBES)
        answer = self.probe(prompt)
        expected = self.probe_answers.get(prompt)
        outcome.detail = f"{prompt!r}"
        if expected is not None and answer != expected:
            outcome.mismatch, outcome.detail = True, f"{prompt!r}: {answer!r} != alone {expected!r}"

    def probe(self, prompt: str) -> str:
        with self.openai() as client:
            reply = client.chat.completions.create(model=self.target.model, temperature=0.0, max_tokens=12,
                                                   messages=[{"role": "user", "content": prompt}])
        return reply.choices[0].message.content

    def _bad(self, rng, outcome):
        variant = rng.randrange(5)
        outcome.detail = f"bad variant {variant}"
        with httpx.Client(base_url=self.target.base_url, timeout=REQUEST_DEADLINE_S) as client:
            if variant == 0:
                r = client.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                                headers={"content-type": "application/json"})
            elif variant == 1:
                r = client.post("/v1/chat/completions", json={**self._chat_kwargs(rng), "max_tokens": -3})
            elif variant == 2:
                r = client.post("/v1/chat/completions", json={**self._chat_kwargs(rng), "model": "no-such-model"})
            elif variant == 3:
                r = client.post("/v1/chat/completions", json={"model": self.target.model, "messages": "hello"})
            else:
                r = client.post("/v1/chat/completions", json={"model": self.target.model, "max_tokens": 4, "messages": [
                    {"role": "user", "content": words(rng, 2 * self.target.max_model_len)}]})
        outcome.status = r.status_code

    def _disconnect(self, rng, outcome):
        with self.openai() as client:
            stream = client.chat.completions.create(**{**self._chat_kwargs(rng), "max_tokens": 64}, stream=True)
            for i, _ in enumerate(stream):
                if i >= 2:
                    break
            stream.close()
        outcome.status = "left"

    def _abort(self, rng, outcome):
        try:
            with self.openai(timeout=0.2) as client:
                client.chat.completions.create(**{**self._chat_kwargs(rng), "max_tokens": 64})
        except openai.APITimeoutError:
            pass
        outcome.status = "left"

    def _never_read(self, rng, outcome):
        """Sends a streaming request and never reads the answer, then leaves after a few seconds."""
        host, port = self.target.base_url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({**self._chat_kwargs(rng), "max_tokens": 64, "stream": True}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(head + body)
            time.sleep(rng.uniform(1.0, 4.0))
        outcome.status = "left"
