"""Who may count as a rank (qnext/distributed/rank_handshake.py, rank_heartbeat.py), over sockets on 127.0.0.1
without JAX: a stranger's bytes, a duplicate rank, a wrong or missing cluster secret, another checkpoint or other
engine options are refused and change no rank's state; a follower refuses a rank 0 without the secret; ranks
beyond the loopback need a secret (`qnext serve` exits 2 naming the flag)."""
from __future__ import annotations

import shutil
import socket
import threading
import time

import pytest

from qnext.distributed.cluster_secret import ClusterSecret
from qnext.distributed.rank_handshake import HandshakeRefused, RankCredentials, checkpoint_identity, introduce
from qnext.distributed.rank_heartbeat import HeartbeatSender, RankMonitor
from qnext.server.launch import free_port

SECRET = ClusterSecret(b"s" * 32)
OPTIONS = {"max_num_seqs": 4, "block_size": 16}


def credentials(identity: str = "ckpt-a", options: dict = OPTIONS, secret=SECRET) -> RankCredentials:
    return RankCredentials(identity=identity, options=dict(options), secret=secret)


@pytest.fixture
def monitor():
    port = free_port()
    m = RankMonitor(3, ("127.0.0.1", port), timeout_s=5.0, credentials=credentials())
    m.port = port
    try:
        yield m
    finally:
        m.close()


def join(port: int, rank: int, creds: RankCredentials) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        introduce(s, rank, creds)
    except BaseException:
        s.close()
        raise
    return s


def unchanged(monitor) -> bool:
    return monitor.ranks_up == 1 and monitor.missing() == [1, 2] and monitor.failure() is None


def settle() -> None:
    time.sleep(0.3)       # the monitor's connection thread finishes with the refused connection


def test_a_stranger_writing_a_rank_number_changes_nothing(monitor):
    with socket.create_connection(("127.0.0.1", monitor.port), timeout=5) as stranger:
        stranger.sendall(b"1\n")
        stranger.settimeout(5)
        received = b""
        while chunk := stranger.recv(4096):          # the monitor closes the connection
            received += chunk
    assert b'"ok": false' in received and b"JSON object" in received
    settle()
    assert unchanged(monitor), monitor.failure()
    assert "was refused" in monitor.last_refusal
    with join(monitor.port, 1, credentials()):       # the real rank 1 still joins
        wait_for(lambda: monitor.ranks_up == 2)
    wait_for(lambda: monitor.failure() is not None)  # and its exit is still noticed
    assert "rank 1 of 3 closed its connection" in monitor.failure()


def test_a_second_connection_for_a_rank_that_is_up_is_refused(monitor):
    with join(monitor.port, 1, credentials()):
        wait_for(lambda: monitor.ranks_up == 2)
        with pytest.raises(HandshakeRefused, match="rank 1 is already up; a second process claims it"):
            join(monitor.port, 1, credentials())
        settle()
        assert monitor.ranks_up == 2 and monitor.failure() is None and monitor.missing() == [2]
        assert "already up" in monitor.last_refusal


@pytest.mark.parametrize("secret, words", [(None, "not signed with rank 0's cluster secret"),
                                           (ClusterSecret(b"t" * 32), "not signed with rank 0's cluster secret")])
def test_a_follower_without_the_secret_is_refused(monitor, secret, words):
    with pytest.raises(HandshakeRefused, match=words):
        join(monitor.port, 1, credentials(secret=secret))
    settle()
    assert unchanged(monitor)


def test_another_checkpoint_is_refused_naming_both_digests(monitor):
    with pytest.raises(HandshakeRefused) as refused:
        join(monitor.port, 2, credentials(identity="ckpt-b"))
    assert "rank 2 loaded a different checkpoint: its identity is ckpt-b, rank 0's is ckpt-a" in str(refused.value)
    with pytest.raises(HandshakeRefused, match="max_num_seqs: 8 there, 4 on rank 0"):
        join(monitor.port, 2, credentials(options={**OPTIONS, "max_num_seqs": 8}))
    with pytest.raises(HandshakeRefused, match="rank 3 is not a follower of this engine"):
        join(monitor.port, 3, credentials())
    settle()
    assert unchanged(monitor)


def test_a_follower_refuses_a_rank0_without_the_secret():
    """A process posing as rank 0 (it accepts anything) cannot prove the secret: the follower does not follow it."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        port = fake.getsockname()[1]

        def fake_rank0():
            conn, _ = fake.accept()
            with conn:
                conn.sendall(b'{"nonce": "n"}\n')
                conn.recv(4096)
                conn.sendall(b'{"ok": true, "mac": ""}\n')
                time.sleep(0.5)

        thread = threading.Thread(target=fake_rank0, daemon=True)
        thread.start()
        with pytest.raises(HandshakeRefused, match="does not hold the cluster secret"):
            HeartbeatSender(("127.0.0.1", port), 1, credentials(), connect_timeout_s=5)
        thread.join(5)


def test_the_checkpoint_identity_follows_config_and_weights(tmp_path, tiny_checkpoint):
    source = tiny_checkpoint("qwen3_5", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert checkpoint_identity(copy) == checkpoint_identity(source)
    weights = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF                          # one weight byte (the last file's end is always sampled)
    weights.write_bytes(bytes(data))
    assert checkpoint_identity(copy) != checkpoint_identity(source)


def test_ranks_beyond_the_loopback_need_a_secret(monkeypatch, tmp_path):
    from qnext.server import cli, multinode

    def no_follow(*args):
        raise AssertionError("a rank beyond the loopback started without a cluster secret")

    monkeypatch.setattr(multinode, "follow", no_follow)
    monkeypatch.delenv("QNEXT_CLUSTER_SECRET", raising=False)
    code = cli.main(["serve", str(tmp_path), "--nnodes", "2", "--node-rank", "1",
                     "--dist-init-addr", "192.0.2.1:29500"])
    assert code == 2
    args = cli.build_parser()[0].parse_args(["serve", "--nnodes", "2", "--dist-init-addr", "192.0.2.1:29500"])
    with pytest.raises(ValueError, match="--dist-init-addr reaches beyond the loopback .*--cluster-secret-file"):
        multinode.rank_secret(args)
    secret_file = tmp_path / "secret"
    secret_file.write_text("k" * 32)
    args.cluster_secret_file = str(secret_file)
    assert multinode.rank_secret(args).matches("k" * 32)


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
