"""Pictures fetched by http(s) URL (`qnext serve --allow-media-urls`), within the server's address policy and limits.

Address policy: the URL's host is resolved once and every address it resolves to is checked; the connection goes
to a checked address (the name is never resolved again, so a second DNS answer cannot swap in another address).
Refused: loopback, private, link-local, shared (100.64/10), multicast, unspecified, reserved, documentation and
every other not globally routable address, and the cloud metadata addresses, in IPv4 and IPv6 alike (an IPv6
address that embeds an IPv4 one, v4-mapped, 6to4 or NAT64, is judged by the IPv4 address). An operator who needs
an internal host names it, or its network, in `MediaLimits.url_allow` (--media-url-allow; empty by default); a
metadata address passes only when a listed network holds it.

Redirects are not followed: a 3xx answer is an error that names where it pointed (send that URL instead).
One deadline covers all of a request's fetches (resolution, connection, TLS, headers and body; a fetch past it is
cut off), and each body is bounded by max_image_bytes: refused from Content-Length when given, and while reading.
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse

METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_CHUNK = 1 << 16
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class FetchError(ValueError):
    """A URL this server will not or could not fetch; the message says why (media.py names the part)."""


class Deadline:
    """One clock for all the fetches of a request."""

    def __init__(self, seconds: float):
        self.seconds, self._end = seconds, time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left; FetchError once none are."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise FetchError(f"fetching the request's media URLs took more than {self.seconds:g} s, this server's "
                             "limit per request (--media-fetch-timeout)")
        return left


class UrlAllowList:
    """Hosts and networks (CIDRs) an operator lets through the address policy; empty by default."""

    def __init__(self, entries: tuple[str, ...] = ()):
        self.hosts, self.networks = set(), []
        for entry in entries:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not entry or "/" in entry or not all(c.isalnum() or c in "-._" for c in entry):
                    raise ValueError(f"--media-url-allow entry {entry!r} is neither a host name nor an IP "
                                     "network (e.g. images.internal or 10.1.2.0/24)") from None
                self.hosts.add(entry.lower().rstrip("."))

    def admits(self, host: str, address: Address) -> bool:
        if any(address in n for n in self.networks if n.version == address.version):
            return True
        return host.lower().rstrip(".") in self.hosts and address not in METADATA_ADDRESSES


def refused_kind(address: Address) -> str | None:
    """Why the policy refuses an address ("loopback", "private", ...), or None for a public one."""
    if address.version == 6:
        embedded = address.ipv4_mapped or address.sixtofour or (
            ipaddress.IPv4Address(int(address) & 0xFFFFFFFF) if address in _NAT64 else None)
        if embedded is not None:
            kind = refused_kind(embedded)
            return None if kind is None else f"{kind} (embedded in {address})"
    checks = (("metadata", address in METADATA_ADDRESSES), ("unspecified", address.is_unspecified),
              ("loopback", address.is_loopback), ("link-local", address.is_link_local),
              ("multicast", address.is_multicast), ("reserved", address.is_reserved),
              ("private", address.is_private), ("not globally routable", not address.is_global))
    return next((kind for kind, hit in checks if hit), None)


def fetch(url: str, max_bytes: int, allow: UrlAllowList, deadline: Deadline) -> bytes:
    """The body of an http(s) URL within the policy, the deadline and max_bytes; FetchError saying why not."""
    parts = urllib.parse.urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise FetchError(f"{url!r} is not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise FetchError(f"{url!r} is not an http(s) URL with a host")
    addresses = checked_addresses(host, port, allow, deadline)
    target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    host_header = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    connection = _PinnedConnection(parts.scheme, host, port, addresses, deadline)
    try:
        conn = connection.open()
        conn.request("GET", target, headers={"Host": host_header, "User-Agent": "qnext", "Accept": "image/*"})
        return _body(url, conn.getresponse(), max_bytes, deadline)
    except (OSError, http.client.HTTPException) as e:
        deadline.remaining()                                   # cut off at the deadline: say so
        raise FetchError(f"fetching {url!r} failed: {e}") from None
    finally:
        connection.close()


def _body(url: str, response: http.client.HTTPResponse, max_bytes: int, deadline: Deadline) -> bytes:
    if 300 <= response.status < 400:
        raise FetchError(f"{url!r} answered {response.status} redirecting to {response.getheader('Location')!r}; "
                         "this server does not follow redirects: send the URL it points to")
    if response.status != 200:
        raise FetchError(f"{url!r} answered {response.status} {response.reason}")
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise FetchError(f"{url!r} is {int(length)} bytes (Content-Length); this server takes at most {max_bytes} "
                         "bytes per image (--max-image-bytes)")
    body = bytearray()
    while chunk := response.read1(_CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise FetchError(f"{url!r} is more than {max_bytes} bytes; this server takes at most {max_bytes} bytes "
                             "per image (--max-image-bytes)")
        deadline.remaining()
    deadline.remaining()                                       # a body cut off at the deadline ends early
    return bytes(body)


def checked_addresses(host: str, port: int, allow: UrlAllowList, deadline: Deadline) -> list[Address]:
    """Every address `host` resolves to (once), each admitted by the policy; FetchError naming a refused one."""
    addresses = [ipaddress.ip_address(a.split("%")[0]) for a in _resolve(host, port, deadline)]
    for address in addresses:
        kind = refused_kind(address)
        if kind is not None and not allow.admits(host, address):
            raise FetchError(f"{host!r} resolves to {address}, a {kind} address; this server fetches media from "
                             "public addresses only (an operator can let a host or network through with "
                             "--media-url-allow)")
    if not addresses:
        raise FetchError(f"{host!r} resolves to no address")
    return addresses


def _resolve(host: str, port: int, deadline: Deadline) -> list[str]:
    """The host's addresses, waiting at most the deadline (the resolver has no timeout of its own)."""
    found: list = []

    def run():
        try:
            found.append([info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)])
        except OSError as e:
            found.append(e)

    worker = threading.Thread(target=run, name="qnext-media-resolve", daemon=True)
    worker.start()
    worker.join(deadline.remaining())
    deadline.remaining()
    if not found:
        raise FetchError(f"resolving {host!r} took past this request's media deadline (--media-fetch-timeout)")
    if isinstance(found[0], OSError):
        raise FetchError(f"{host!r} could not be resolved: {found[0]}")
    return list(dict.fromkeys(found[0]))


class _PinnedConnection:
    """An HTTP(S) connection to one of the checked addresses (the host name kept for Host and TLS), shut down when
    the deadline passes, whatever it is waiting for."""

    def __init__(self, scheme: str, host: str, port: int, addresses: list[Address], deadline: Deadline):
        self.scheme, self.host, self.port, self.addresses, self.deadline = scheme, host, port, addresses, deadline
        self.sock = self._timer = None

    def open(self) -> http.client.HTTPConnection:
        error = None
        for address in self.addresses:
            try:
                self.sock = socket.create_connection((str(address), self.port), timeout=self.deadline.remaining())
                break
            except OSError as e:
                error = e
        if self.sock is None:
            raise FetchError(f"connecting to {self.host!r} failed: {error}")
        self._timer = threading.Timer(self.deadline.remaining(), self._cut_off)
        self._timer.daemon = True
        self._timer.start()
        if self.scheme == "https":
            self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.deadline.remaining())
        conn.sock = self.sock                                  # already connected: connect() is never called
        return conn

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.sock is not None:
            self.sock.close()

    def _cut_off(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
