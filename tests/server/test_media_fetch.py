"""Pictures fetched by URL (--allow-media-urls, qnext/vision/media_fetch.py): loopback, private, link-local,
multicast, reserved, unspecified and metadata addresses are refused after resolution without any connection (a
picture server on 127.0.0.1 sees none), IPv4 and IPv6 alike; the connection goes to the address that was checked;
redirects are not followed; one deadline covers all of a request's fetches; the body is bounded by
--max-image-bytes. Only 127.0.0.1 is ever connected to: other addresses come from a replaced resolver, and the
connect function is replaced by one that fails the test."""
from __future__ import annotations

import http.server
import io
import socket
import threading
import time

import pytest

from qnext.vision.media import MediaError, MediaLimits, MediaPart, decode_media
from tests.support.vision_checkpoint import picture

PNG = io.BytesIO()
picture(1).save(PNG, format="PNG")
PNG = PNG.getvalue()
URLS = MediaLimits(allow_urls=True)
LOCAL = MediaLimits(allow_urls=True, url_allow=("127.0.0.1/32",))        # the test server let through


class PictureServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    connections = 0
    requests: list[str]

    def process_request(self, request, client_address):
        self.connections += 1
        super().process_request(request, client_address)


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.requests.append(self.path)
        try:
            getattr(self, "answer_" + self.path.strip("/").split(".")[0].replace("-", "_"))()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def send(self, status: int, body: bytes, **headers):
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def answer_pic(self):
        self.send(200, PNG, Content_Length=str(len(PNG)), Content_Type="image/png")

    def answer_redirect(self):
        self.send(302, b"", Location="ftp://127.0.0.1/pic.png", Content_Length="0")

    def answer_big(self):
        self.send(200, PNG, Content_Length="100000000")

    def answer_big_unsized(self):                  # no Content-Length: the body ends when the connection closes
        self.close_connection = True
        self.send(200, PNG * 4)

    def answer_slow_body(self):                    # headers at once, then a byte every 0.1 s
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        for _ in range(1000):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(0.1)

    def answer_slow_headers(self):                 # the status line and headers a byte every 0.1 s
        for byte in b"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\nX-Padding: " + b"x" * 100:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.1)

    def answer_late(self):                         # the whole answer after 0.6 s
        time.sleep(0.6)
        self.answer_pic()


@pytest.fixture(scope="module")
def server():
    with PictureServer(("127.0.0.1", 0), Handler) as srv:
        srv.requests = []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        yield srv
        srv.shutdown()


def fetch(url: str, limits: MediaLimits = URLS, count: int = 1):
    return decode_media([MediaPart("image", url, f"m.{i}") for i in range(count)], limits)


@pytest.fixture(autouse=True)
def only_loopback(monkeypatch):
    """Whatever the code under test does, no connection leaves 127.0.0.1."""
    connect = socket.create_connection

    def loopback_only(address, *args, **kwargs):
        assert address[0] == "127.0.0.1", f"a connection to {address} was attempted"
        return connect(address, *args, **kwargs)
    monkeypatch.setattr(socket, "create_connection", loopback_only)


@pytest.fixture
def no_connect(monkeypatch, only_loopback):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a connection was attempted: {args}")
    monkeypatch.setattr(socket, "create_connection", refuse)


def resolve_to(monkeypatch, *addresses: str) -> list:
    calls = []

    def getaddrinfo(host, port, *args, **kwargs):
        calls.append(host)
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in addresses]
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return calls


@pytest.mark.parametrize("url, address", [("http://127.0.0.1:{port}/pic.png", r"127\.0\.0\.1"),
                                          ("http://localhost:{port}/pic.png", r"127\.0\.0\.1"),
                                          ("https://[::1]:{port}/pic.png", "::1")])
def test_a_picture_server_on_loopback_is_refused_without_a_connection(server, no_connect, url, address):
    before = server.connections
    with pytest.raises(MediaError, match=rf"resolves to {address}, a loopback address; this server fetches media "
                                         "from public addresses only .*--media-url-allow") as e:
        fetch(url.format(port=server.server_port))
    assert e.value.where == "m.0"
    assert server.connections == before


@pytest.mark.parametrize("address, kind", [
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("169.254.169.254", "metadata"),
    ("169.254.1.1", "link-local"), ("100.64.0.1", "not globally routable"), ("100.100.100.200", "metadata"),
    ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("::1", "loopback"), ("::", "unspecified"), ("fe80::1", "link-local"), ("fc00::1", "private"),
    ("fd00:ec2::254", "metadata"), ("ff02::1", "multicast"), ("::ffff:10.0.0.1", r"private \(embedded in"),
    ("::ffff:127.0.0.1", "loopback"), ("64:ff9b::a9fe:a9fe", "metadata"), ("2002:a00:1::", "private"),
])
def test_internal_addresses_are_refused_after_resolution(monkeypatch, no_connect, address, kind):
    calls = resolve_to(monkeypatch, address)
    with pytest.raises(MediaError, match=f"'pics.example' resolves to .*a {kind}"):
        fetch("http://pics.example/pic.png")
    assert calls == ["pics.example"]


def test_every_resolved_address_is_checked(monkeypatch, no_connect):
    resolve_to(monkeypatch, "93.184.216.34", "10.0.0.7")
    with pytest.raises(MediaError, match=r"resolves to 10\.0\.0\.7, a private address"):
        fetch("https://pics.example/pic.png")


def test_the_connection_goes_to_the_checked_address_without_resolving_again(monkeypatch):
    calls = resolve_to(monkeypatch, "93.184.216.34")
    connected = []

    def connect(address, timeout=None, *args):
        connected.append(address)
        raise ConnectionRefusedError("refused by the test")
    monkeypatch.setattr(socket, "create_connection", connect)
    with pytest.raises(MediaError, match="connecting to 'pics.example' failed"):
        fetch("http://pics.example:8080/pic.png")
    assert calls == ["pics.example"] and connected == [("93.184.216.34", 8080)]


def test_the_allow_list_lets_a_named_network_or_host_through(server, monkeypatch):
    images, _ = fetch(f"http://127.0.0.1:{server.server_port}/pic.png", LOCAL)
    assert images[0].size == (32, 32)
    resolve_to(monkeypatch, "127.0.0.1")
    images, _ = fetch(f"http://pics.internal:{server.server_port}/pic.png",
                      MediaLimits(allow_urls=True, url_allow=("pics.internal",)))
    assert images[0].size == (32, 32)


def test_a_named_host_never_reaches_a_metadata_address(monkeypatch, no_connect):
    resolve_to(monkeypatch, "169.254.169.254")
    with pytest.raises(MediaError, match="a metadata address"):
        fetch("http://pics.internal/pic.png", MediaLimits(allow_urls=True, url_allow=("pics.internal",)))
    with pytest.raises(ValueError, match="--media-url-allow entry 'http://x' is neither a host name nor"):
        MediaLimits(url_allow=("http://x",))


def test_https_speaks_tls_to_the_checked_address(server):
    before = server.connections
    with pytest.raises(MediaError, match=r"fetching 'https://127\.0\.0\.1:\d+/pic\.png' failed: .*SSL"):
        fetch(f"https://127.0.0.1:{server.server_port}/pic.png", LOCAL)        # the test server speaks plain http
    assert server.connections == before + 1


def test_redirects_are_not_followed(server):
    server.requests.clear()
    with pytest.raises(MediaError, match=r"answered 302 redirecting to 'ftp://127.0.0.1/pic.png'; this server does "
                                         "not follow redirects"):
        fetch(f"http://127.0.0.1:{server.server_port}/redirect", LOCAL)
    assert server.requests == ["/redirect"]


def test_the_body_is_bounded_by_content_length_and_while_reading(server):
    limits = MediaLimits(allow_urls=True, url_allow=("127.0.0.1/32",), max_image_bytes=len(PNG) + 10)
    with pytest.raises(MediaError, match=r"is 100000000 bytes \(Content-Length\); .* at most \d+ bytes per image "
                                         r"\(--max-image-bytes\)"):
        fetch(f"http://127.0.0.1:{server.server_port}/big", limits)
    with pytest.raises(MediaError, match=r"is more than \d+ bytes; .*\(--max-image-bytes\)"):
        fetch(f"http://127.0.0.1:{server.server_port}/big-unsized", limits)


def test_one_deadline_covers_a_slow_body_and_all_of_a_requests_fetches(server):
    limits = MediaLimits(allow_urls=True, url_allow=("127.0.0.1/32",), fetch_timeout_s=1.0)
    for path, count in (("slow-body", 1), ("slow-headers", 1), ("late", 2)):   # drip-fed; two answers of 0.6 s
        start = time.monotonic()
        with pytest.raises(MediaError, match=r"took more than 1 s, this server's limit per request "
                                             r"\(--media-fetch-timeout\)"):
            fetch(f"http://127.0.0.1:{server.server_port}/{path}", limits, count)
        assert time.monotonic() - start < 1.5
    assert len(fetch(f"http://127.0.0.1:{server.server_port}/late", limits)[0]) == 1
