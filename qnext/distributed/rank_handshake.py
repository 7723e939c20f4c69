"""The handshake that opens a follower's heartbeat connection to rank 0 (rank_heartbeat.py): who may count as a rank.

One JSON line each way, in this order:
  rank 0   -> {"nonce": N0}
  follower -> {"rank": R, "identity": I, "options": {...}, "nonce": N1, "mac": M}
  rank 0   -> {"ok": true, "mac": W}  or  {"ok": false, "error": "why"}
M = HMAC(secret, "qnext-rank-hello", N0, R, I, options) proves the follower holds the cluster secret and binds its
claims to this connection (a recorded hello does not replay: N0 is new each time); W = HMAC(secret,
"qnext-rank-welcome", N1, N0, R) proves rank 0 holds it too. Without a secret (allowed on the loopback only) M and
W are empty and the rest is still checked. Rank 0 refuses a hello whose MAC, identity (RankCredentials.identity)
or engine options differ from its own, or whose rank is out of range; the monitor also refuses a rank that is
already up. A line is at most MAX_LINE_BYTES and must arrive within the handshake timeout."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import time
from pathlib import Path

from qnext.distributed.cluster_secret import ClusterSecret, new_nonce

MAX_LINE_BYTES = 16384
HANDSHAKE_TIMEOUT_S = 10.0
SAMPLE_BYTES = 1 << 20            # of each weight file's tensor data, at its start, middle and end
MAX_HEADER_BYTES = 100 << 20      # safetensors' own limit on a header
NOT_COMPARED_OPTIONS = ("compilation_cache_dir",)     # per host; they do not change what the engine computes


class HandshakeRefused(ValueError):
    """A handshake that failed: said to the other side (rank 0) or heard from it (a follower)."""


@dataclasses.dataclass(frozen=True, repr=False)
class RankCredentials:
    """What every rank of one engine presents alike: the checkpoint's identity, the engine options and the secret."""
    identity: str
    options: dict
    secret: ClusterSecret | None

    @classmethod
    def of(cls, model_dir, engine_options: dict, secret: ClusterSecret | None) -> "RankCredentials":
        return cls(checkpoint_identity(model_dir), comparable_options(engine_options), secret)


def checkpoint_identity(model_dir) -> str:
    """A digest of a checkpoint computed before any engine exists (the handshake precedes the load): config.json,
    the tokenizer files, and per weight file its name, size, safetensors header (every tensor's name, dtype, shape,
    offsets) and SAMPLE_BYTES of tensor data at the start, middle and end. It reads a few MiB whatever the
    checkpoint's size; two checkpoints equal in all of that but different elsewhere in their weights pass."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        path = model_dir / name
        data = path.read_bytes() if path.is_file() else b""
        h.update(name.encode() + len(data).to_bytes(8, "big") + data)
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(path.name.encode() + b"\0" + size.to_bytes(8, "big"))
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, MAX_HEADER_BYTES)))
            for at in (8 + header_len, (8 + header_len + size) // 2, size - SAMPLE_BYTES):
                f.seek(max(0, at))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def comparable_options(engine_options: dict) -> dict:
    """The engine options every rank must share (as JSON would carry them)."""
    kept = {k: v for k, v in engine_options.items() if k not in NOT_COMPARED_OPTIONS}
    return json.loads(json.dumps(kept, sort_keys=True, default=str))


# ---- rank 0 ------------------------------------------------------------------------------------------------------
def hear_follower(conn: socket.socket, credentials: RankCredentials, nnodes: int,
                  timeout_s: float = HANDSHAKE_TIMEOUT_S) -> tuple[int, dict, str]:
    """Sends the nonce and checks the follower's hello -> (its rank, the hello, our nonce). HandshakeRefused with the
    reason (to log and to send back with `refuse`) when the hello is malformed, unauthenticated or not this engine's."""
    nonce = new_nonce()
    deadline = time.monotonic() + timeout_s
    send_line(conn, {"nonce": nonce})
    hello = read_line(conn, deadline)
    rank, identity, options = hello.get("rank"), hello.get("identity"), hello.get("options")
    if not (isinstance(rank, int) and isinstance(identity, str) and isinstance(options, dict)
            and isinstance(hello.get("nonce"), str) and isinstance(hello.get("mac"), str)):
        raise HandshakeRefused("a hello needs rank (an integer), identity, options, nonce and mac")
    secret = credentials.secret
    if secret is None and hello["mac"]:
        raise HandshakeRefused("the follower signs with a cluster secret and rank 0 has none: give every rank the "
                               "same --cluster-secret-file")
    if secret is not None and not secret.verify(hello["mac"], *_hello_parts(nonce, rank, identity, options)):
        raise HandshakeRefused(f"rank {rank}'s hello is not signed with rank 0's cluster secret (missing or "
                               "different --cluster-secret-file)")
    if not 0 < rank < nnodes:
        raise HandshakeRefused(f"rank {rank} is not a follower of this engine (ranks 1..{nnodes - 1}; --nnodes "
                               f"{nnodes})")
    if identity != credentials.identity:
        raise HandshakeRefused(f"rank {rank} loaded a different checkpoint: its identity is {identity}, rank 0's is "
                               f"{credentials.identity}; start every rank with the same checkpoint")
    if options != credentials.options:
        differ = sorted(k for k in {*options, *credentials.options} if options.get(k) != credentials.options.get(k))
        raise HandshakeRefused(f"rank {rank} runs other engine options than rank 0: "
                               + "; ".join(f"{k}: {options.get(k)!r} there, {credentials.options.get(k)!r} on rank 0"
                                           for k in differ) + "; start every rank with the same options")
    return rank, hello, nonce


def welcome(conn: socket.socket, credentials: RankCredentials, hello: dict, nonce: str) -> None:
    mac = credentials.secret.sign("qnext-rank-welcome", hello["nonce"], nonce, str(hello["rank"])) \
        if credentials.secret is not None else ""
    send_line(conn, {"ok": True, "mac": mac})


def refuse(conn: socket.socket, why: str) -> None:
    try:
        send_line(conn, {"ok": False, "error": why})
    except OSError:
        pass


# ---- a follower --------------------------------------------------------------------------------------------------
def introduce(conn: socket.socket, rank: int, credentials: RankCredentials,
              timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The follower's side: returns once rank 0 has accepted this rank and proved the secret (when there is one);
    HandshakeRefused with rank 0's reason otherwise."""
    deadline = time.monotonic() + timeout_s
    offer = read_line(conn, deadline)
    if not isinstance(offer.get("nonce"), str):
        raise HandshakeRefused("the process at rank 0's heartbeat port did not offer a handshake (is it qnext?)")
    own_nonce, secret = new_nonce(), credentials.secret
    mac = secret.sign(*_hello_parts(offer["nonce"], rank, credentials.identity, credentials.options)) \
        if secret is not None else ""
    send_line(conn, {"rank": rank, "identity": credentials.identity, "options": credentials.options,
                     "nonce": own_nonce, "mac": mac})
    verdict = read_line(conn, deadline)
    if verdict.get("ok") is not True:
        raise HandshakeRefused(f"rank 0 refused this rank: {verdict.get('error') or 'no reason given'}")
    if secret is not None and not secret.verify(verdict.get("mac"), "qnext-rank-welcome", own_nonce, offer["nonce"],
                                                str(rank)):
        raise HandshakeRefused("the process at rank 0's heartbeat port does not hold the cluster secret")


# ---- lines -------------------------------------------------------------------------------------------------------
def _hello_parts(nonce: str, rank: int, identity: str, options: dict) -> tuple[str, ...]:
    return "qnext-rank-hello", nonce, str(rank), identity, json.dumps(options, sort_keys=True)


def send_line(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def read_line(conn: socket.socket, deadline: float) -> dict:
    """One JSON object line, byte by byte (nothing after the newline is consumed); HandshakeRefused when it is
    malformed, too long or late, or the connection closes first."""
    data = bytearray()
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or len(data) > MAX_LINE_BYTES:
            raise HandshakeRefused("the handshake was too slow or too long")
        conn.settimeout(left)
        try:
            byte = conn.recv(1)
        except OSError as e:            # socket.timeout included
            raise HandshakeRefused(f"the handshake failed ({e or 'timed out'})") from None
        if not byte:
            raise HandshakeRefused("the connection closed during the handshake")
        data += byte
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        message = None
    if not isinstance(message, dict):
        raise HandshakeRefused("the handshake line is not a JSON object")
    return message
