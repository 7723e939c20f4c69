"""The host tier in the narrow storage dtypes (cache/cache_dtypes.py): fp8 KV blocks round-trip exactly, a float32
snapshot row is rounded once to bfloat16 when saved and widened back to float32 when loaded; the layout's byte
counts are the narrow ones."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cache.cache_dtypes import kv_storage_dtype, snapshot_storage_dtype
from cache.device_buffers import CacheBuffers, CacheLayout
from cache.host_tier_buffers import allocate_host_buffers
from cache.stats import TierStats
from cache.transfers import TransferQueue

SIZES = dict(num_kv_layers=1, num_kv_heads=2, head_dim=4, num_state_layers=1, conv_width=3, conv_dim=5, num_v_heads=2,
             k_head_dim=3, v_head_dim=3, dtype="bfloat16")
NARROW = CacheLayout(**SIZES, kv_dtype="float8_e4m3fn", snapshot_dtype="bfloat16")
WIDE = CacheLayout(**SIZES)


def test_byte_counts_follow_the_storage_dtypes():
    assert NARROW.kv_bytes_per_block(16) * 2 == WIDE.kv_bytes_per_block(16)
    assert NARROW.state_bytes_per_row == WIDE.state_bytes_per_row      # the device's live / snapshot rows: float32
    recurrent = 2 * 3 * 3
    assert WIDE.snapshot_bytes_per_row - NARROW.snapshot_bytes_per_row == recurrent * 2


def test_host_tier_round_trips_fp8_blocks_and_rounds_snapshots_to_bf16_once():
    rng = np.random.default_rng(0)
    pages = np.asarray(rng.standard_normal((2, 4, 2, 4))).astype(ml_dtypes.float8_e4m3fn)   # the buffers are donated
    recurrent = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    recurrent[0] = 0
    buffers = CacheBuffers(kv=((jnp.asarray(pages), jnp.asarray(pages)),), conv=(jnp.zeros((3, 2, 5), jnp.bfloat16),),
                           recurrent=(jnp.asarray(recurrent),))
    host = allocate_host_buffers(NARROW, num_blocks=2, block_size=2, num_snapshots=1)
    assert host.kv[0][0].dtype.name == "float8_e4m3fn" and host.recurrent[0].dtype.name == "bfloat16"
    q = TransferQueue()
    q.save_block(1, 0)
    q.save_row(1, 0)
    q.load_block(0, 3)          # block 1's content into block 3
    q.load_row(0, 2)            # row 1's state into row 2
    out = host.apply(q.take(), buffers, TierStats())
    np.testing.assert_array_equal(np.asarray(out.kv[0][0][:, 3]), pages[:, 1])
    assert out.recurrent[0].dtype == jnp.float32
    rounded = recurrent[1].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out.recurrent[0][2]), rounded)
    assert not np.array_equal(rounded, recurrent[1])


@pytest.mark.parametrize("call, value", [(lambda v: kv_storage_dtype(v, "bfloat16"), "int8"),
                                         (snapshot_storage_dtype, "fp8")])
def test_unknown_cache_dtypes_name_the_choices(call, value):
    with pytest.raises(ValueError, match="must be one of"):
        call(value)


def test_option_values_map_to_storage_dtypes():
    assert kv_storage_dtype("auto", "bfloat16") == "bfloat16"
    assert kv_storage_dtype("fp8", "bfloat16") == kv_storage_dtype("fp8_e4m3", "float32") == "float8_e4m3fn"
    assert snapshot_storage_dtype("auto") == "float32" and snapshot_storage_dtype("bfloat16") == "bfloat16"


def test_a_narrow_device_pool_moves_snapshot_rows_to_and_from_the_host_tier_unrounded():
    """Device rows 0..2 (zero, live, staging) are float32, ids 3.. the bf16 pool: a pool row saved and loaded back
    keeps its bf16 bits; a host slot loaded into a live row is widened there; the ids address the right buffer."""
    from cache.buffer_copies import gather_device_rows
    from cache.device_buffers import allocate_cache_buffers, split_rows

    rng = np.random.default_rng(1)
    buffers = allocate_cache_buffers(NARROW, num_blocks=2, block_size=2, num_state_rows=3, num_pool_rows=3,
                                     num_staging_rows=1)
    assert buffers.first_pool_row == 3 and buffers.snapshot_recurrent[0].dtype == jnp.bfloat16
    pool = rng.standard_normal((3, 2, 3, 3)).astype(ml_dtypes.bfloat16)
    live = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    live[0] = 0
    buffers = buffers.replace(recurrent=(jnp.asarray(live),), snapshot_recurrent=(jnp.asarray(pool),))
    assert [(part, at, index) for part, at, index in split_rows(buffers, [4, 1, 3])] == [
        (("conv", "recurrent"), [1], [1]), (("snapshot_conv", "snapshot_recurrent"), [0, 2], [1, 0])]
    np.testing.assert_array_equal(gather_device_rows(buffers, [5, 3], 0, "recurrent"), pool[[2, 0]])
    host = allocate_host_buffers(NARROW, num_blocks=1, block_size=2, num_snapshots=2)
    q = TransferQueue()
    q.save_row(4, 0)            # pool row 1 -> host slot 0
    q.load_row(0, 5)            # ... -> pool row 2
    q.load_row(0, 1)            # ... -> live row 1, widened
    out = host.apply(q.take(), buffers, TierStats())
    np.testing.assert_array_equal(host.recurrent[0][0], pool[1])
    np.testing.assert_array_equal(np.asarray(out.snapshot_recurrent[0][2]), pool[1])
    np.testing.assert_array_equal(np.asarray(out.recurrent[0][1]), pool[1].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(out.snapshot_recurrent[0][:2]), pool[:2])   # nothing else written
    np.testing.assert_array_equal(np.asarray(out.recurrent[0][2]), live[2])


def test_a_pool_needs_staging_rows():
    from cache.device_buffers import allocate_cache_buffers

    with pytest.raises(ValueError, match="needs num_staging_rows > 0"):
        allocate_cache_buffers(NARROW, num_blocks=2, block_size=2, num_state_rows=3, num_pool_rows=3)
