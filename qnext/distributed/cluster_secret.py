"""The cluster secret: one shared key that authenticates qnext's internal links (rank heartbeats and handshakes,
the prefill/decode `/pd/*` routes and their transfer offers), apart from the clients' `--api-key`.

Given as a file (`--cluster-secret-file PATH`, the whole file's bytes, surrounding white space stripped) or the
environment (`QNEXT_CLUSTER_SECRET`); never as a plain flag, which `ps` would show. Every comparison is constant time
(hmac.compare_digest). Links that stay on the loopback may run without a secret; `require_secret_beyond_loopback`
refuses to start one that reaches beyond it without (docs/security.md)."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

SECRET_ENV = "QNEXT_CLUSTER_SECRET"
SECRET_HEADER = "x-qnext-cluster-key"       # HTTP links (/pd/*) carry the secret in this header
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, repr=False)
class ClusterSecret:
    key: bytes

    def __post_init__(self):
        if len(self.key) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret has {len(self.key)} bytes; it needs at least {MIN_SECRET_BYTES} "
                             "(e.g. `python -c \"import secrets; print(secrets.token_hex(32))\" > secret`)")

    def __repr__(self) -> str:               # never the key itself in a log or a traceback
        return "ClusterSecret(<hidden>)"

    def matches(self, presented: str | bytes | None) -> bool:
        """Whether `presented` (e.g. a header's value) is the secret; constant time."""
        if presented is None:
            return False
        if isinstance(presented, str):
            presented = presented.encode()
        return hmac.compare_digest(presented, self.key)

    def sign(self, *parts: str | bytes) -> str:
        """HMAC-SHA256 (hex) of the parts, each length-prefixed so that no two part lists sign alike."""
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in parts:
            data = part.encode() if isinstance(part, str) else bytes(part)
            mac.update(len(data).to_bytes(8, "big") + data)
        return mac.hexdigest()

    def verify(self, signature: str | bytes | None, *parts: str | bytes) -> bool:
        if signature is None:
            return False
        if isinstance(signature, bytes):
            signature = signature.decode("ascii", "replace")
        return hmac.compare_digest(signature, self.sign(*parts))


def new_nonce() -> str:
    return secrets.token_hex(16)


def load_cluster_secret(path: str | os.PathLike | None = None, environ=os.environ) -> ClusterSecret | None:
    """The secret from `path` (a file) or else $QNEXT_CLUSTER_SECRET; None when neither is given."""
    if path is not None:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"cannot read the cluster secret file {path}: {e.strerror}") from None
        if not key:
            raise ValueError(f"the cluster secret file {path} is empty")
        return ClusterSecret(key)
    value = environ.get(SECRET_ENV, "").strip()
    return ClusterSecret(value.encode()) if value else None


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address, as given on a command line) names this machine's loopback only."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_secret_beyond_loopback(secret: ClusterSecret | None, hosts, what: str) -> None:
    """Raises ValueError when a link reaches beyond the loopback (any of `hosts` is not a loopback address or
    name) and no cluster secret was given: such a link would trust whoever can connect to it."""
    if secret is not None:
        return
    outside = [h for h in hosts if not is_loopback_host(h)]
    if outside:
        raise ValueError(f"{what} reaches beyond the loopback ({', '.join(sorted(set(outside)))}) without a cluster "
                         f"secret: give every process the same --cluster-secret-file FILE (or ${SECRET_ENV}); "
                         "see docs/security.md")


def add_cluster_secret_arguments(parser) -> None:
    parser.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                        help=f"the shared secret of the internal links (ranks, /pd/*); default ${SECRET_ENV}; needed "
                             "when those links leave the loopback (docs/security.md)")
