"""A PD server's options (`qnext serve --pd-role ...`, docs/pd.md and docs/security.md): its role, its links to
the other side and their limits, checked before anything loads.

A link that leaves the loopback needs the cluster secret: a PD server refuses to start without one when its JAX
transfer server (`--pd-transfer-host`), a prefill server it fetches from (`--pd-prefill-url`), or, for a prefill
server, its HTTP address (`--host`, which serves /pd/*) is not a loopback address."""
from __future__ import annotations

import dataclasses
import urllib.parse

from qnext.distributed.cluster_secret import ClusterSecret, load_cluster_secret, require_secret_beyond_loopback
from qnext.engine.pd_requests import DEFAULT_BUNDLE_TTL_S, DEFAULT_MAX_BUNDLE_BYTES
from qnext.server.pd_mover import DEFAULT_OFFER_TTL_S, DEFAULT_TIMEOUT_S

PD_ROLES = ("prefill", "decode")


def prefill_url_allow_list(role: str | None, prefill_urls) -> tuple[str, ...]:
    """`--pd-prefill-url` checked against `--pd-role`: the prefill servers (http(s)://host:port) a decode server may
    fetch from, without a trailing slash. A decode server needs at least one; other roles take none."""
    urls = tuple(u.rstrip("/") for u in prefill_urls or ())
    if role == "decode" and not urls:
        raise ValueError("--pd-role decode needs --pd-prefill-url URL (repeatable): the prefill servers it may fetch "
                         "from; the x-qnext-pd header of a request names one of them")
    if role != "decode" and urls:
        raise ValueError("--pd-prefill-url is for --pd-role decode")
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
            raise ValueError(f"--pd-prefill-url {url!r} is not a server's base URL (http(s)://host:port)")
    return urls


@dataclasses.dataclass(frozen=True)
class PDOptions:
    """role: "prefill" or "decode". transfer_host: where this process's JAX transfer server listens. prefill_urls:
    a decode server's allow-list (prefill_url_allow_list). secret: the cluster secret, wanted on /pd/* and sent
    when fetching. timeout_s: each wait of a decode server on a prefill server (metadata, offer, arrays). A prefill
    server's bundles: dropped bundle_ttl_s after the prompt ran, or oldest first past max_bundle_bytes (host
    memory); its transfer offers: dropped offer_ttl_s after they were made."""
    role: str
    transfer_host: str = "127.0.0.1"
    prefill_urls: tuple[str, ...] = ()
    secret: ClusterSecret | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    offer_ttl_s: float = DEFAULT_OFFER_TTL_S
    bundle_ttl_s: float = DEFAULT_BUNDLE_TTL_S
    max_bundle_bytes: int = DEFAULT_MAX_BUNDLE_BYTES

    def __post_init__(self):
        if self.role not in PD_ROLES:
            raise ValueError(f"--pd-role must be one of {PD_ROLES}, got {self.role!r}")
        object.__setattr__(self, "prefill_urls", prefill_url_allow_list(self.role, self.prefill_urls))
        for flag, value in (("--pd-timeout", self.timeout_s), ("--pd-offer-ttl", self.offer_ttl_s),
                            ("--pd-bundle-ttl", self.bundle_ttl_s), ("--pd-max-bundle-bytes", self.max_bundle_bytes)):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        require_secret_beyond_loopback(self.secret, [self.transfer_host], f"--pd-transfer-host {self.transfer_host}")
        hosts = [urllib.parse.urlsplit(url).hostname for url in self.prefill_urls]
        require_secret_beyond_loopback(self.secret, hosts, f"--pd-prefill-url {' '.join(self.prefill_urls)}")

    def check_http_host(self, host: str) -> None:
        """A prefill server's /pd/* routes are reachable wherever its HTTP server listens."""
        if self.role == "prefill":
            require_secret_beyond_loopback(self.secret, [host], f"--host {host} (a prefill server's /pd/* routes)")


def pd_options_from_args(args) -> PDOptions | None:
    """`qnext serve`'s PD flags, checked (ValueError saying which flag is wrong); None without --pd-role."""
    prefill_url_allow_list(args.pd_role, args.pd_prefill_url)
    if args.pd_role is None:
        return None
    options = PDOptions(args.pd_role, args.pd_transfer_host, tuple(args.pd_prefill_url),
                        load_cluster_secret(args.cluster_secret_file), args.pd_timeout, args.pd_offer_ttl,
                        args.pd_bundle_ttl, args.pd_max_bundle_bytes)
    options.check_http_host(args.host)
    return options


def add_pd_arguments(p) -> None:
    p.add_argument("--pd-role", choices=PD_ROLES, default=None,
                   help="one side of prefill/decode disaggregation behind `qnext pd-router` (docs/pd.md)")
    p.add_argument("--pd-transfer-host", default="127.0.0.1",
                   help="with --pd-role: the address this process's JAX transfer server listens on (beyond the "
                        "loopback: a private network only, and --cluster-secret-file; docs/security.md)")
    p.add_argument("--pd-prefill-url", action="append", default=[], metavar="URL",
                   help="with --pd-role decode (needed there; repeat for several): a prefill server this server may "
                        "fetch from; a request naming any other gets a 400")
    p.add_argument("--pd-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="with --pd-role decode: how long each wait on a prefill server (metadata, offer, arrays) may "
                        "take before the request fails with 504")
    p.add_argument("--pd-bundle-ttl", type=float, default=DEFAULT_BUNDLE_TTL_S, metavar="SECONDS",
                   help="with --pd-role prefill: a prompt's KV and state not taken by a decode server within this "
                        "are dropped")
    p.add_argument("--pd-max-bundle-bytes", type=int, default=DEFAULT_MAX_BUNDLE_BYTES, metavar="BYTES",
                   help="with --pd-role prefill: host memory for prompts' KV and state waiting for a decode server; "
                        "past it the oldest are dropped")
    p.add_argument("--pd-offer-ttl", type=float, default=DEFAULT_OFFER_TTL_S, metavar="SECONDS",
                   help="with --pd-role prefill: an array offer on the transfer server not pulled within this is "
                        "dropped (its device memory freed)")
