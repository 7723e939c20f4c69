"""Moving a prefill bundle (qnext/engine/pd_transfer.py) between processes: the metadata over HTTP, the arrays
with JAX's transfer engine (`jax.experimental.transfer`, docs/pd.md).

Prefill side: `PrefillMover.prepare(bundle, first_block, num_kv_layers)` puts the slices the decode side asked for
on this process's first device and offers them to the transfer server under a fresh random 62-bit uuid
(`await_pull`, single use, dropped after `offer_ttl_s`); the HTTP route returns the uuid, the server's address and
each array's name, shape and dtype. Decode side: `read_bundle_meta(url, request_id, ...)` reads the metadata (GET,
off the engine thread), `RemoteBundle.fetch` asks for the missing blocks (POST), checks the offer against what the
metadata implies and pulls exactly that (`TransferConnection.pull`) onto its own first device, then to host
memory. Every wait across the process boundary has a deadline (`timeout_s`): a peer that does not answer in time
fails the request (504), one that answers wrongly fails it too (502). One transfer server per process, started on
first use, on the address given (127.0.0.1 in the tests). The transfer server itself cannot be authenticated: it
must stay on a private network (docs/security.md); its offers are reachable only through the uuid, which only the
secret-guarded `/pd/*` routes hand out.
"""
from __future__ import annotations

import datetime
import re
import secrets
import threading
import time
import urllib.parse

import httpx
import jax
import jax.numpy as jnp
import numpy as np

from qnext.distributed.cluster_secret import SECRET_HEADER, ClusterSecret
from qnext.engine.pd_transfer import PrefillBundle, bundle_nbytes, check_arrays, expected_arrays
from qnext.server.engine_errors import RequestError

PD_HEADER = "x-qnext-pd"         # the router's instructions to a prefill or decode server (JSON)
PD_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")     # request ids in PD headers and /pd/ URLs (no dots, no slashes)
DEFAULT_TIMEOUT_S = 30.0         # --pd-timeout: each wait of a decode server on a prefill server
DEFAULT_OFFER_TTL_S = 60.0       # --pd-offer-ttl: an offer nobody pulled is dropped after this

_lock = threading.Lock()
_servers: dict[str, object] = {}
_connections: dict[tuple[str, str], object] = {}     # (local host, remote address) -> TransferConnection
_http: list[httpx.Client] = []                       # the decode side's client to prefill servers (kept alive)


def check_pd_id(value, what: str) -> str:
    if not isinstance(value, str) or not PD_ID.fullmatch(value):
        raise ValueError(f"{what} must be 1 to 128 letters, digits, '-' or '_', got {value!r}")
    return value


def http_client() -> httpx.Client:
    with _lock:
        if not _http:
            _http.append(httpx.Client(timeout=DEFAULT_TIMEOUT_S))
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
    def __init__(self, host: str = "127.0.0.1", offer_ttl_s: float = DEFAULT_OFFER_TTL_S):
        if offer_ttl_s <= 0:
            raise ValueError(f"--pd-offer-ttl must be positive, got {offer_ttl_s}")
        self.host, self.offer_ttl_s = host, offer_ttl_s

    def prepare(self, bundle: PrefillBundle, first_block: int, num_kv_layers: int) -> dict:
        """Offers the slices for one pull; returns what the puller needs to ask for them. The transfer server
        drops an offer nobody pulled within offer_ttl_s (when the next offer arrives)."""
        server = transfer_server(self.host)
        arrays = bundle.fetch(first_block, num_kv_layers)
        names = sorted(name for name, a in arrays.items() if a.size)      # (no blocks missing: nothing to pull)
        device = jax.devices()[0]
        placed = [jax.device_put(np.ascontiguousarray(arrays[name]), device) for name in names]
        uuid = secrets.randbits(62)
        if placed:
            expiry = datetime.datetime.now() + datetime.timedelta(seconds=self.offer_ttl_s)
            server.await_pull(uuid, placed, timeout=expiry)
        return {"uuid": uuid, "address": server.address(),
                "arrays": [[name, list(arrays[name].shape), arrays[name].dtype.name] for name in names],
                "empty": [[name, list(a.shape), a.dtype.name] for name, a in arrays.items() if not a.size]}


def _secret_headers(secret: ClusterSecret | None) -> dict:
    return {} if secret is None else {SECRET_HEADER: secret.key}


def _bundle_url(url: str, request_id: str) -> str:
    return f"{url.rstrip('/')}/pd/bundles/{urllib.parse.quote(check_pd_id(request_id, 'prefill_request_id'), safe='')}"


def _peer_error(url: str, what: str, e: Exception, timeout_s: float) -> RequestError:
    if isinstance(e, httpx.TimeoutException):
        return RequestError(f"the prefill server {url} did not {what} within --pd-timeout {timeout_s:g} s", 504)
    return RequestError(f"the prefill server {url} could not {what}: {e!r}", 502)


def read_bundle_meta(url: str, request_id: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                     secret: ClusterSecret | None = None) -> dict | None:
    """The metadata of bundle `request_id` on the prefill server `url`; None when it has none (never made,
    pulled, expired). RequestError 504 past the deadline, 502 for any other failure."""
    try:
        response = http_client().get(_bundle_url(url, request_id), timeout=timeout_s, headers=_secret_headers(secret))
    except httpx.HTTPError as e:
        raise _peer_error(url, f"send bundle {request_id!r}'s metadata", e, timeout_s) from None
    if response.status_code == 404:
        return None
    if response.status_code != 200:
        raise RequestError(f"the prefill server {url} answered {response.status_code} for bundle {request_id!r}'s "
                           f"metadata: {response.text[:500]}", 502)
    try:
        meta = response.json()
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise RequestError(f"the prefill server {url} sent bundle {request_id!r}'s metadata as no JSON object", 502)
    return meta


class RemoteBundle:
    """A bundle held by a prefill server at `url` (the BundleSource of engine/pd_transfer.py), its metadata read."""

    def __init__(self, url: str, request_id: str, meta: dict, timeout_s: float = DEFAULT_TIMEOUT_S,
                 secret: ClusterSecret | None = None, host: str = "127.0.0.1"):
        self.url, self.request_id, self.meta, self.timeout_s = url.rstrip("/"), request_id, meta, timeout_s
        self.secret, self.host = secret, host
        self.bytes_moved = 0

    def fetch(self, first_block: int, num_kv_layers: int) -> dict[str, np.ndarray]:
        """The arrays, each checked against what the metadata implies; RequestError 504 when the offer or the
        pull does not complete within timeout_s, 502 when the peer offers or sends anything else."""
        deadline = time.monotonic() + self.timeout_s
        expected = expected_arrays(self.meta, first_block, num_kv_layers)
        try:
            response = http_client().post(f"{_bundle_url(self.url, self.request_id)}/pull", timeout=self.timeout_s,
                                          json={"first_block": first_block, "num_kv_layers": num_kv_layers},
                                          headers=_secret_headers(self.secret))
        except httpx.HTTPError as e:
            raise _peer_error(self.url, f"offer bundle {self.request_id!r}", e, self.timeout_s) from None
        if response.status_code != 200:
            raise RequestError(f"the prefill server {self.url} could not offer bundle {self.request_id!r}: "
                               f"{response.status_code} {response.text[:500]}", 502)
        try:
            offer = response.json()
            announced = {name: (tuple(shape), dtype) for name, shape, dtype in offer["arrays"] + offer["empty"]}
            uuid, address = int(offer["uuid"]), str(offer["address"])
        except (ValueError, KeyError, TypeError) as e:
            raise RequestError(f"the prefill server {self.url} sent a malformed offer ({e!r})", 502) from None
        if announced != expected:
            raise RequestError(f"the prefill server {self.url} offered {sorted(announced.items())}, not what bundle "
                               f"{self.request_id!r}'s metadata implies: {sorted(expected.items())}", 502)
        arrays = self._pull(uuid, address, {n: s for n, s in expected.items() if np.prod(s[0]) > 0}, deadline)
        self.bytes_moved += bundle_nbytes(arrays)
        arrays.update({name: np.zeros(shape, jnp.dtype(dtype)) for name, (shape, dtype) in expected.items()
                       if name not in arrays})
        check_arrays(arrays, expected)
        return arrays

    def _pull(self, uuid: int, address: str, wanted: dict, deadline: float) -> dict[str, np.ndarray]:
        """Pulls exactly `wanted` (name -> (shape, dtype)), polling until deadline (a pull of an offer that is gone
        never completes; nothing else bounds it)."""
        if not wanted:
            return {}
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        names = sorted(wanted)
        specs = [jax.ShapeDtypeStruct(wanted[n][0], jnp.dtype(wanted[n][1]), sharding=sharding) for n in names]
        pulled = connection(self.host, address).pull(uuid, specs)
        pause = 0.001
        while not all(a.is_ready() for a in pulled):
            if time.monotonic() > deadline:
                raise RequestError(f"the arrays of bundle {self.request_id!r} did not arrive from the prefill server "
                                   f"{self.url} within --pd-timeout {self.timeout_s:g} s", 504)
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        try:
            return {name: np.asarray(a) for name, a in zip(names, pulled)}
        except Exception as e:       # noqa: BLE001 (the runtime's error for an offer that did not match)
            raise RequestError(f"the prefill server {self.url} sent bundle {self.request_id!r}'s arrays other than "
                               f"announced: {e}", 502) from None
