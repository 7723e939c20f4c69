"""Moving a prefill bundle (qnext/engine/pd_transfer.py) between processes: the metadata over HTTP, the arrays
with JAX's transfer engine (`jax.experimental.transfer`, docs/scale.md).

Prefill side: `PrefillMover.prepare(bundle, first_block, num_kv_layers)` puts the slices the decode side asked for
on this process's first device and offers them to the transfer server under a fresh uuid (`await_pull`); the
HTTP route returns the uuid, the server's address and each array's name, shape and dtype. Decode side:
`RemoteBundle(url, request_id)` reads the metadata (GET), then `fetch` asks for the missing blocks (POST) and pulls
them (`TransferConnection.pull`) onto its own first device, then to host memory. One transfer server per process,
started on first use, on the address given (127.0.0.1 in the tests).
"""
from __future__ import annotations

import secrets
import threading

import httpx
import jax
import jax.numpy as jnp
import numpy as np

from qnext.engine.pd_transfer import PrefillBundle, bundle_nbytes

PD_HEADER = "x-qnext-pd"         # the router's instructions to a prefill or decode server (JSON)

_lock = threading.Lock()
_servers: dict[str, object] = {}
_connections: dict[tuple[str, str], object] = {}     # (local host, remote address) -> TransferConnection
_http: list[httpx.Client] = []                       # the decode side's client to prefill servers (kept alive)


def http_client() -> httpx.Client:
    with _lock:
        if not _http:
            _http.append(httpx.Client(timeout=60.0))
        return _http[0]


def transfer_server(host: str = "127.0.0.1"):
    """This process's transfer server on `host` (started once, on the first device's client)."""
    from jax.experimental import transfer

    with _lock:
        if host not in _servers:
            client = jax.devices()[0].client
            _servers[host] = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        return _servers[host]


def connection(host: str, address: str):
    """This process's connection to the transfer server at `address` (made once)."""
    server = transfer_server(host)
    with _lock:
        if (host, address) not in _connections:
            _connections[(host, address)] = server.connect(address)
        return _connections[(host, address)]


class PrefillMover:
    def __init__(self, host: str = "127.0.0.1"):
        self.host = host

    def prepare(self, bundle: PrefillBundle, first_block: int, num_kv_layers: int) -> dict:
        """Offers the slices for one pull; returns what the puller needs to ask for them."""
        server = transfer_server(self.host)
        arrays = bundle.fetch(first_block, num_kv_layers)
        names = sorted(name for name, a in arrays.items() if a.size)      # (no blocks missing: nothing to pull)
        device = jax.devices()[0]
        placed = [jax.device_put(np.ascontiguousarray(arrays[name]), device) for name in names]
        uuid = secrets.randbits(62)
        if placed:
            server.await_pull(uuid, placed)
        return {"uuid": uuid, "address": server.address(),
                "arrays": [[name, list(arrays[name].shape), arrays[name].dtype.name] for name in names],
                "empty": [[name, list(a.shape), a.dtype.name] for name, a in arrays.items() if not a.size]}


class RemoteBundle:
    """A bundle held by a prefill server at `url` (the BundleSource of engine/pd_transfer.py)."""

    def __init__(self, url: str, request_id: str, timeout: float = 60.0, host: str = "127.0.0.1"):
        self.url, self.request_id, self.timeout, self.host = url.rstrip("/"), request_id, timeout, host
        response = http_client().get(f"{self.url}/pd/bundles/{request_id}", timeout=timeout)
        if response.status_code != 200:
            raise ValueError(f"the prefill server {url} has no bundle {request_id!r}: {response.text}")
        self.meta = response.json()
        self.bytes_moved = 0

    def fetch(self, first_block: int, num_kv_layers: int) -> dict[str, np.ndarray]:
        response = http_client().post(f"{self.url}/pd/bundles/{self.request_id}/pull", timeout=self.timeout,
                                      json={"first_block": first_block, "num_kv_layers": num_kv_layers})
        if response.status_code != 200:
            raise ValueError(f"the prefill server {self.url} could not offer bundle {self.request_id!r}: "
                             f"{response.text}")
        offer = response.json()
        device = jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        specs = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
                 for _, shape, dtype in offer["arrays"]]
        pulled = connection(self.host, offer["address"]).pull(offer["uuid"], specs) if specs else []
        arrays = {name: np.asarray(a) for (name, _, _), a in zip(offer["arrays"], pulled)}
        self.bytes_moved += bundle_nbytes(arrays)
        arrays.update({name: np.zeros(shape, jnp.dtype(dtype)) for name, shape, dtype in offer["empty"]})
        return arrays
