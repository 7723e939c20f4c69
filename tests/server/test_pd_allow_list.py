"""A decode server's allow-list of prefill servers (`--pd-prefill-url`): needed with `--pd-role decode`, refused
elsewhere (a flag that would do nothing is an error), base URLs only; `qnext serve` says so and exits 2 before
loading anything."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qnext.server.pd_options import prefill_url_allow_list


def test_the_allow_list_is_base_urls_for_a_decode_server_only():
    assert prefill_url_allow_list("decode", ["http://10.0.0.5:8001/", "https://p.example:443"]) == (
        "http://10.0.0.5:8001", "https://p.example:443")
    assert prefill_url_allow_list("prefill", []) == prefill_url_allow_list(None, None) == ()
    with pytest.raises(ValueError, match="--pd-role decode needs --pd-prefill-url"):
        prefill_url_allow_list("decode", [])
    with pytest.raises(ValueError, match="is for --pd-role decode"):
        prefill_url_allow_list("prefill", ["http://127.0.0.1:8001"])
    for bad in ("127.0.0.1:8001", "file:///etc/passwd", "http://127.0.0.1:8001/pd/bundles", "http://h:1/?a=b"):
        with pytest.raises(ValueError, match="is not a server's base URL"):
            prefill_url_allow_list("decode", [bad])


def test_serve_refuses_a_decode_role_without_prefill_urls_and_prefill_urls_without_it(tmp_path):
    for flags, said in [(["--pd-role", "decode"], "--pd-role decode needs --pd-prefill-url"),
                        (["--pd-prefill-url", "http://127.0.0.1:8001"], "--pd-prefill-url is for --pd-role decode")]:
        run = subprocess.run([sys.executable, "-m", "qnext.server", str(tmp_path / "no-model"), *flags, "--port", "1"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert run.returncode == 2, run.stderr[-2000:]
        assert said in run.stderr, run.stderr[-2000:]


def test_pd_links_beyond_the_loopback_need_the_cluster_secret():
    from qnext.distributed.cluster_secret import ClusterSecret
    from qnext.server.pd_options import PDOptions

    secret = ClusterSecret(b"s" * 32)
    for options, flag in [(dict(role="prefill", transfer_host="0.0.0.0"), "--pd-transfer-host 0.0.0.0"),
                          (dict(role="decode", prefill_urls=("http://10.0.0.5:8001",)), "--pd-prefill-url"),
                          (dict(role="decode", prefill_urls=("http://127.0.0.1:8001", "http://p.example:80")),
                           "p.example")]:
        with pytest.raises(ValueError, match=f"{flag}.*without a cluster secret"):
            PDOptions(**options)
        PDOptions(**options, secret=secret)                          # with the secret: fine
    PDOptions("decode", prefill_urls=("http://localhost:8001", "http://[::1]:8001"))     # loopback: no secret needed
    with pytest.raises(ValueError, match="--host 10.1.2.3 .*without a cluster secret"):
        PDOptions("prefill").check_http_host("10.1.2.3")
    PDOptions("decode", prefill_urls=("http://127.0.0.1:1",)).check_http_host("0.0.0.0")  # clients' side: --api-key
    with pytest.raises(ValueError, match="--pd-timeout must be positive"):
        PDOptions("decode", prefill_urls=("http://127.0.0.1:1",), timeout_s=0)


def test_serve_refuses_pd_links_beyond_the_loopback_without_a_secret(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "QNEXT_CLUSTER_SECRET"}
    run = subprocess.run([sys.executable, "-m", "qnext.server", str(tmp_path / "no-model"), "--pd-role", "prefill",
                          "--host", "0.0.0.0", "--port", "1"], capture_output=True, text=True, timeout=120,
                         env={**env, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--host 0.0.0.0" in run.stderr and "--cluster-secret-file" in run.stderr, run.stderr[-2000:]
