import logging

import pytest

from cache import snapshot_budget_bytes, snapshot_pool_capacity

MIB = 1 << 20


def test_capacity_is_bounded_by_the_budget_and_logs_both_numbers(caplog):
    with caplog.at_level(logging.INFO, logger="qnext.cache"):
        assert snapshot_pool_capacity(128, 74 * MIB, 1000 * MIB) == 13
    [rec] = caplog.records
    assert rec.name == "qnext.cache" and "128" in rec.getMessage() and "13" in rec.getMessage()


def test_no_log_when_the_configured_maximum_fits(caplog):
    with caplog.at_level(logging.INFO, logger="qnext.cache"):
        assert snapshot_pool_capacity(8, 74 * MIB, 1000 * MIB) == 8
    assert not caplog.records


def test_zero_budget_disables_cleanly(caplog):
    with caplog.at_level(logging.INFO, logger="qnext.cache"):
        assert snapshot_pool_capacity(16, 74 * MIB, 10 * MIB) == 0
    assert "off" in caplog.records[0].getMessage()


def test_budget_as_bytes_or_device_fraction():
    assert snapshot_budget_bytes(5 * MIB) == 5 * MIB
    assert snapshot_budget_bytes(0.25, device_memory_bytes=80 * MIB) == 20 * MIB
    with pytest.raises(ValueError):
        snapshot_budget_bytes(0.25)
    with pytest.raises(ValueError):
        snapshot_budget_bytes(1.5, device_memory_bytes=MIB)
