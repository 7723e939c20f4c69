"""The LoRA adapters a server serves by name (`qnext serve --enable-lora --lora-modules name=path ...`, vLLM's
flags): a request's `model` picks one (the base model's names pick none), `/v1/models` lists them with `parent` =
the base model, and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` change them while serving.

An adapter is read and checked when it is registered (a directory that is not a PEFT adapter, a rank above
max_lora_rank, a module the model lacks, shapes of another base: a 400 naming it); the engine reads it again (its
host cache, keyed on the weights file) when a request uses it. With data parallel process replicas the HTTP side
has no model config: the shapes are then checked by the replica on the adapter's first request (also a 400).
Unloading takes the name away from new requests; requests already running finish with it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading

from fastapi import Request
from fastapi.responses import PlainTextResponse

from qnext.config import ModelConfig
from qnext.lora.adapter_weights import check_targets, leaf_targets
from qnext.lora.peft_format import AdapterError, read_peft_adapter
from qnext.lora.registry import LoRARequest
from qnext.server.errors import APIError, bad_request


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """vLLM's --lora-modules values: `name=path`, or JSON `{"name": ..., "path": ...}` -> [(name, path)]."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON: {e}") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: a JSON module needs string fields 'name' and 'path'")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {value!r} is neither name=path nor JSON "
                                 '{"name": ..., "path": ...}')
        if not name or not path:
            raise ValueError(f"--lora-modules {value!r}: the name and the path must not be empty")
        modules.append((name, path))
    return modules


class AdapterLoadError(ValueError):
    """An adapter that cannot be registered; `param` is the field at fault (lora_name or lora_path)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    digest: str           # the weights digest (qnext/lora/peft_format.py) as registered


class ServedAdapters:
    """name -> adapter, thread-safe. `engine`: the served engine (its model_config and config, when it has them)."""

    def __init__(self, engine, base_names: tuple[str, ...], max_lora_rank: int | None = None):
        cfg = getattr(engine, "model_config", None)
        self._targets = leaf_targets(cfg) if isinstance(cfg, ModelConfig) else None
        config = getattr(engine, "config", None)
        self.max_lora_rank = max_lora_rank or getattr(config, "max_lora_rank", None)
        self.base_names = base_names
        self._adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def get(self, name: str) -> ServedAdapter | None:
        with self._lock:
            return self._adapters.get(name)

    def load(self, name: str, path: str) -> ServedAdapter:
        """Registers the adapter at `path` as `name`; AdapterLoadError naming what is wrong."""
        if name in self.base_names:
            raise AdapterLoadError(f"the LoRA adapter name {name!r} is the base model's name; choose another",
                                   "lora_name")
        self._check_new(name)
        try:
            adapter = read_peft_adapter(path)
            if self._targets is not None:
                check_targets(adapter, self._targets, self.max_lora_rank or adapter.max_rank)
        except AdapterError as e:
            raise AdapterLoadError(f"cannot load LoRA adapter {name!r}: {e}", "lora_path") from None
        with self._lock:
            self._check_new(name)
            served = ServedAdapter(LoRARequest(name, next(self._ids), str(path)), adapter.digest)
            self._adapters[name] = served
        return served

    def _check_new(self, name: str) -> None:
        if name in self._adapters:
            raise AdapterLoadError(f"the LoRA adapter {name!r} has already been loaded; unload it first",
                                   "lora_name")

    def unload(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise APIError(404, f"the LoRA adapter {name!r} cannot be found; loaded: "
                               f"{', '.join(repr(n) for n in self._adapters) or 'none'}", param="lora_name",
                               code="lora_adapter_not_found")


def install_lora_routes(app, adapters: ServedAdapters, api_key: str | None) -> None:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}, vLLM's
    routes and answers. They read server-side paths, so they are served only behind an API key (`--api-key`: the
    auth middleware wants it on every /v1 route); without one they answer 403. (vLLM gates them behind its
    VLLM_ALLOW_RUNTIME_LORA_UPDATING environment variable instead.)"""
    async def body_of(request: Request, fields: tuple[str, ...]) -> dict:
        if not api_key:
            raise APIError(403, "loading and unloading LoRA adapters at run time needs a server started with "
                           "--api-key (the routes read server-side paths); or name them with --lora-modules",
                           type="permission_error", code="runtime_lora_updating_disabled")
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise bad_request(f"the request body is not valid JSON: {e}", "body") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object", "body")
        for field in fields:
            if not isinstance(body.get(field), str) or not body[field]:
                raise bad_request(f"{' and '.join(repr(f) for f in fields)} must be given as non-empty strings; "
                                  f"{field!r} is {body.get(field)!r}", field)
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await body_of(request, ("lora_name", "lora_path"))
        name = body["lora_name"]
        try:
            await asyncio.to_thread(adapters.load, name, body["lora_path"])
        except AdapterLoadError as e:
            raise bad_request(str(e), e.param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        name = (await body_of(request, ("lora_name",)))["lora_name"]
        adapters.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def adapter_cards(adapters: ServedAdapters, parent: str, created: int, max_model_len: int) -> list[dict]:
    """/v1/models entries of the adapters (vLLM's: root = the adapter's path, parent = the base model)."""
    cards = []
    for name in adapters.names():
        served = adapters.get(name)
        if served is not None:
            cards.append({"id": name, "object": "model", "created": created, "owned_by": "qnext",
                          "root": served.request.lora_path, "parent": parent, "max_model_len": max_model_len})
    return cards
