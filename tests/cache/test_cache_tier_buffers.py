"""The copies between the device buffers and the host tier's arrays (cache/device_buffers.py) against numpy:
phases in order, saves before loads, padding writes nothing (the zero state row stays zero), pieces of MAX_COPY."""
import jax.numpy as jnp
import numpy as np
import pytest

import cache.buffer_copies as buffer_copies
from cache.device_buffers import CacheBuffers, CacheLayout
from cache.buffer_copies import gather_device_blocks, gather_device_rows
from cache.host_tier_buffers import allocate_host_buffers
from cache.stats import TierStats
from cache.transfers import TransferQueue

LAYOUT = CacheLayout(num_kv_layers=2, num_kv_heads=2, head_dim=4, num_state_layers=1, conv_width=3, conv_dim=5,
                     num_v_heads=2, k_head_dim=3, v_head_dim=3)
BS, BLOCKS, ROWS = 2, 9, 6


def random_buffers(rng) -> CacheBuffers:
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    page = (2, BLOCKS, BS, 4)
    conv, recurrent = r(ROWS, 2, 5), r(ROWS, 2, 3, 3)
    conv[0] = recurrent[0] = 0                                 # the zero state row
    return CacheBuffers(kv=tuple((jnp.asarray(r(*page)), jnp.asarray(r(*page))) for _ in range(2)),
                        conv=(jnp.asarray(conv),), recurrent=(jnp.asarray(recurrent),))


def as_numpy(buffers: CacheBuffers):
    return ([(np.array(k), np.array(v)) for k, v in buffers.kv], np.array(buffers.conv[0]),
            np.array(buffers.recurrent[0]))


@pytest.mark.parametrize("max_copy", [256, 2])
def test_a_plan_runs_phase_by_phase_saves_before_loads(monkeypatch, max_copy):
    monkeypatch.setattr(buffer_copies, "MAX_COPY", max_copy)
    rng = np.random.default_rng(0)
    buffers = random_buffers(rng)
    kv, conv, recurrent = as_numpy(buffers)
    host = allocate_host_buffers(LAYOUT, num_blocks=4, block_size=BS, num_snapshots=2)
    q = TransferQueue()
    for block, slot in ((3, 0), (4, 1), (6, 2)):
        q.save_block(block, slot)
    q.load_block(0, 5)            # block 3's content into block 5
    q.load_block(3, 3)            # slot 3 (zeros) into block 3: after block 3 was saved
    q.save_block(5, 3)            # block 5 was just loaded: a new phase saves what it holds then
    q.save_row(4, 1)
    q.load_row(1, 2)              # row 4's state into row 2
    stats = TierStats()
    out_kv, out_conv, out_recurrent = as_numpy(host.apply(q.take(), buffers, stats))
    for (k, v), (hk, hv), (ok, ov) in zip(kv, host.kv, out_kv):
        for pages, saved, out in ((k, hk, ok), (v, hv, ov)):
            assert np.array_equal(saved[:, [0, 1, 2, 3]], pages[:, [3, 4, 6, 3]])
            expected = pages.copy()
            expected[:, 5], expected[:, 3] = pages[:, 3], 0
            assert np.array_equal(out, expected)
    expected_conv, expected_recurrent = conv.copy(), recurrent.copy()
    expected_conv[2], expected_recurrent[2] = conv[4], recurrent[4]
    assert np.array_equal(out_conv, expected_conv) and np.array_equal(out_recurrent, expected_recurrent)
    assert not out_conv[0].any() and not out_recurrent[0].any()
    assert stats.bytes_to_host == 4 * host.block_bytes() + host.row_bytes()
    assert stats.bytes_to_device == 2 * host.block_bytes() + host.row_bytes()


def test_gathers_for_the_cache_file_read_exactly_the_blocks_and_rows_asked(monkeypatch):
    monkeypatch.setattr(buffer_copies, "MAX_COPY", 2)
    buffers = random_buffers(np.random.default_rng(1))
    kv, conv, recurrent = as_numpy(buffers)
    got = gather_device_blocks(buffers.kv, [7, 1, 2, 8, 7])
    assert all(np.array_equal(g, pages[:, [7, 1, 2, 8, 7]]) for (k, v), pair in zip(kv, got)
               for pages, g in zip((k, v), pair))
    got_conv, got_recurrent = (gather_device_rows(buffers, [5, 1, 3], 0, kind) for kind in ("conv", "recurrent"))
    assert np.array_equal(got_conv, conv[[5, 1, 3]]) and np.array_equal(got_recurrent, recurrent[[5, 1, 3]])


def test_warm_up_writes_nothing():
    buffers = random_buffers(np.random.default_rng(2))
    before = as_numpy(buffers)
    host = allocate_host_buffers(LAYOUT, num_blocks=4, block_size=BS, num_snapshots=2)
    after = as_numpy(host.warm_up(buffers))
    for (k, v), (k2, v2) in zip(before[0], after[0]):
        assert np.array_equal(k, k2) and np.array_equal(v, v2)
    assert np.array_equal(before[1], after[1]) and np.array_equal(before[2], after[2])
