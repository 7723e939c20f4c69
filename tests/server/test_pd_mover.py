"""The decode side's fetch against a prefill peer that offers arrays its transfer server never serves (a stub on
127.0.0.1 answering the offer route, this process's own transfer server, no model): the pull gives up at
--pd-timeout with a 504 instead of holding a fetch thread for ever; an offer other than the metadata implies is a
502 before anything is pulled."""
from __future__ import annotations

import threading
import time

from qnext.server.pd_mover import RemoteBundle, transfer_server
from tests.support.stub_http import StubServer

LAYOUT = {"block_size": 16, "num_model_kv_layers": 1, "num_mtp_kv_layers": 0, "num_kv_heads": 2, "head_dim": 8,
          "kv_dtype": "float32", "num_state_layers": 1, "conv_shape": [3, 24], "conv_dtype": "float32",
          "recurrent_shape": [2, 4, 4]}
META = {"num_blocks": 2, "layout": LAYOUT}
EXPECTED = [["conv.0", [3, 24], "float32"], ["kv.0.k", [2, 1, 16, 8], "float32"], ["kv.0.v", [2, 1, 16, 8], "float32"],
            ["recurrent.0", [2, 4, 4], "float32"]]


def fetched(offer: dict, timeout_s: float) -> tuple[BaseException | None, float]:
    """What RemoteBundle.fetch(1, 1) raised against a stub offering `offer`, and how long it took (at most 30 s)."""
    stub = StubServer(lambda *request: (200, offer))
    outcome = []

    def fetch():
        t0 = time.monotonic()
        try:
            RemoteBundle(stub.url, "b", META, timeout_s).fetch(1, 1)
            outcome.append((None, time.monotonic() - t0))
        except Exception as e:      # noqa: BLE001 (returned to the test)
            outcome.append((e, time.monotonic() - t0))

    with stub.running():
        thread = threading.Thread(target=fetch, daemon=True)
        thread.start()
        thread.join(30)
    assert outcome, "the fetch still waits after 30 s"
    return outcome[0]


def test_a_pull_that_never_completes_fails_at_the_deadline():
    error, took = fetched({"uuid": 4242, "address": transfer_server().address(), "arrays": EXPECTED, "empty": []},
                          timeout_s=1.0)
    assert getattr(error, "status", None) == 504 and "within --pd-timeout 1 s" in str(error), error
    assert 1.0 <= took < 10


def test_an_offer_other_than_the_metadata_implies_is_refused_before_any_pull():
    short = [EXPECTED[0], ["kv.0.k", [2, 0, 16, 8], "float32"], EXPECTED[2], EXPECTED[3]]
    error, took = fetched({"uuid": 1, "address": "127.0.0.1:1", "arrays": short, "empty": []}, timeout_s=5.0)
    assert getattr(error, "status", None) == 502 and "not what bundle 'b'" in str(error), error
