"""Which ranks of a served engine are up, known to rank 0 within a bounded time.

JAX's collectives say nothing until one is entered, and a rank that hangs (rather than exits) makes the others wait
in it. So every follower also keeps a plain TCP connection to rank 0 (the coordinator's port + 1) and writes one
byte a second on it. The connection opens with a handshake (rank_handshake.py: the follower proves the cluster
secret and presents its rank, checkpoint identity and engine options); one that fails it is closed and changes no
rank's state, and a second connection for a rank already counted is refused. Rank 0's `RankMonitor` counts a rank
up from its handshake; the rank is down when its connection closes (it exited) or when it has been silent for
`timeout_s` (it hangs). Followers connect before they join `jax.distributed`, so rank 0 can say how many have
arrived (and why one was refused) while it waits for the rest."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

from qnext.distributed.rank_handshake import (HANDSHAKE_TIMEOUT_S, HandshakeRefused, RankCredentials, hear_follower,
                                              introduce, refuse, welcome)

logger = logging.getLogger("qnext.distributed")

HEARTBEAT_INTERVAL_S = 1.0
MAX_PENDING_HANDSHAKES = 16      # connections still in their handshake; more are closed at once


def heartbeat_address(dist_init_addr: str) -> tuple[str, int]:
    """Rank 0's heartbeat listener: the coordinator's host, its port + 1."""
    host, _, port = dist_init_addr.rpartition(":")
    return host, int(port) + 1


class RankMonitor:
    """Rank 0: accepts the followers' heartbeat connections and keeps their state (thread-safe)."""

    def __init__(self, nnodes: int, address: tuple[str, int], timeout_s: float, credentials: RankCredentials):
        self.nnodes, self.timeout_s, self.credentials = nnodes, timeout_s, credentials
        self.last_refusal: str | None = None     # why the latest connection was refused (for "did not join")
        self._pending = 0
        self._up: set[int] = set()
        self._down: dict[int, str] = {}          # rank -> why it is down
        self._lock = threading.Lock()
        self._closing = False
        self._num_connected = 0                  # heartbeat connections still open
        self._listener = socket.create_server(address, reuse_port=False)
        threading.Thread(target=self._accept, name="qnext-rank-monitor", daemon=True).start()

    @property
    def ranks_up(self) -> int:
        """Rank 0 and every follower that passed the handshake and has not failed since."""
        with self._lock:
            return 1 + len(self._up)

    def failure(self) -> str | None:
        """Why the engine cannot run (the first rank that went down), or None."""
        with self._lock:
            if not self._down:
                return None
            rank, why = min(self._down.items())
            return (f"rank {rank} of {self.nnodes} {why}; {self.nnodes - len(self._down)} of {self.nnodes} ranks are "
                    f"up: restart every rank (qnext serve ... --nnodes {self.nnodes} --node-rank R)")

    def missing(self) -> list[int]:
        """Ranks that never connected."""
        with self._lock:
            return [r for r in range(1, self.nnodes) if r not in self._up and r not in self._down]

    def wait_for_all(self, timeout_s: float) -> list[int]:
        """Waits until every follower has connected (or one went down) -> the ranks still missing. Rank 0 joins
        jax.distributed only after this: a join that times out aborts the process, which would end the 503s."""
        deadline = time.monotonic() + timeout_s
        while self.missing() and self.failure() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.missing()

    def mark_down(self, rank: int, why: str) -> None:
        with self._lock:
            if self._closing or rank in self._down:
                return
            self._up.discard(rank)
            self._down[rank] = why
        logger.error("rank %d %s", rank, why)

    def close(self, wait_s: float = 0.0) -> None:
        """Stops watching (a shutdown), after waiting up to `wait_s` for the followers to exit (their connections
        to close): a follower leaving jax.distributed needs rank 0's coordination service still up."""
        with self._lock:
            self._closing = True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._num_connected == 0:
                    break
            time.sleep(0.05)
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:              # closed
                return
            with self._lock:
                busy = self._pending >= MAX_PENDING_HANDSHAKES
                self._pending += not busy
            if busy:
                logger.warning("refused a heartbeat connection from %s: %d handshakes already pending", peer[0],
                               MAX_PENDING_HANDSHAKES)
                conn.close()
                continue
            threading.Thread(target=self._watch, args=(conn, peer), name="qnext-rank-heartbeat",
                             daemon=True).start()

    def _watch(self, conn: socket.socket, peer) -> None:
        with conn:
            rank = self._admit(conn, peer)
            if rank is None:
                return
            with self._lock:
                self._num_connected += 1
            try:
                self._watch_beats(conn, rank)
            finally:
                with self._lock:
                    self._num_connected -= 1

    def _admit(self, conn: socket.socket, peer) -> int | None:
        """The handshake -> the follower's rank, now counted up; None (the connection refused, no state changed)."""
        try:
            rank, hello, nonce = hear_follower(conn, self.credentials, self.nnodes,
                                               min(HANDSHAKE_TIMEOUT_S, self.timeout_s))
            with self._lock:
                if rank in self._up:
                    raise HandshakeRefused(f"rank {rank} is already up; a second process claims it (check "
                                           "--node-rank on every rank)")
                if rank in self._down:
                    raise HandshakeRefused(f"rank {rank} went down and the engine cannot take it back: restart "
                                           "every rank")
                self._up.add(rank)
        except HandshakeRefused as e:
            self.last_refusal = f"a connection from {peer[0]} was refused: {e}"
            logger.warning("rank heartbeat port: %s", self.last_refusal)
            refuse(conn, str(e))
            return None
        except OSError:
            return None
        finally:
            with self._lock:
                self._pending -= 1
        try:
            welcome(conn, self.credentials, hello, nonce)
        except OSError as e:
            self.mark_down(rank, f"lost its connection during the handshake ({e})")
            return None
        logger.info("rank %d of %d connected from %s", rank, self.nnodes, peer[0])
        return rank

    def _watch_beats(self, conn: socket.socket, rank: int) -> None:
        conn.settimeout(self.timeout_s)
        while True:
            try:
                data = conn.recv(64)
            except socket.timeout:
                self.mark_down(rank, f"sent no heartbeat for {self.timeout_s:g} s (hung or cut off)")
                return
            except OSError as e:
                self.mark_down(rank, f"lost its connection ({e})")
                return
            if not data:
                self.mark_down(rank, "closed its connection (the process exited)")
                return


class HeartbeatSender:
    """A follower: connects to rank 0's monitor (retrying until `connect_timeout_s`), passes the handshake
    (HandshakeRefused with rank 0's reason otherwise) and writes a byte a second. When rank 0 goes away this process
    has nothing left to follow: it exits (status 1) unless `stop()` was called."""

    def __init__(self, address: tuple[str, int], rank: int, credentials: RankCredentials, connect_timeout_s: float):
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._sock = socket.create_connection(address, timeout=5)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0's heartbeat listener {address[0]}:{address[1]} did not answer within "
                                       f"{connect_timeout_s:g} s ({e}): start rank 0 first, with the same "
                                       f"--dist-init-addr") from None
                time.sleep(0.2)
        try:
            introduce(self._sock, rank, credentials)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._stopped = threading.Event()
        threading.Thread(target=self._beat, name="qnext-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _beat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._sock.sendall(b".")
            except OSError:
                if not self._stopped.is_set():
                    logger.error("rank 0 went away; this follower exits")
                    os._exit(1)
                return
