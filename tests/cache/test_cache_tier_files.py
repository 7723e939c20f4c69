"""The persisted cache without an engine: the file format (cache/cache_file.py) and the index a restart loads
into the host tier (cache/cache_index.py)."""
import logging
import os

import ml_dtypes
import numpy as np
import pytest

from cache import CacheConfig, CacheManager
from cache.cache_index import export_index, import_index, index_arrays, index_from_arrays
from cache.fingerprint import cache_fingerprint
from cache.cache_file import FILE_NAME, ArraySpec, read_cache_file, write_cache_file
from tests.support.cache_cases import BS, run

FINGERPRINT = cache_fingerprint({"hidden_size": 64}, "weights-digest", "float32", 16)


def spec(name, array):
    return ArraySpec(name, array.dtype.name, array.shape, lambda: array)


def test_arrays_come_back_exactly_and_the_write_is_atomic(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.linspace(-1, 1, 10).astype(ml_dtypes.bfloat16)
    write_cache_file(tmp_path, {"fingerprint": FINGERPRINT, "note": "x"}, [spec("a", a), spec("b", b)])
    f = read_cache_file(tmp_path, FINGERPRINT)
    assert f.header["note"] == "x"
    assert np.array_equal(f.array("a"), a) and f.array("b").dtype == b.dtype and np.array_equal(f.array("b"), b)
    f.close()

    def fail():
        raise OSError("disk full")
    with pytest.raises(OSError):
        write_cache_file(tmp_path, {"fingerprint": FINGERPRINT}, [spec("a", a), ArraySpec("c", "float32", (2,), fail)])
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]          # the old file, no temporary left
    assert np.array_equal(read_cache_file(tmp_path, FINGERPRINT).array("a"), a)


def test_a_write_killed_midway_leaves_no_file_behind_after_the_next_start(tmp_path, caplog):
    """A kill -9 during the save leaves its temporary file (the soak found them piling up): the next start (the
    read) removes it and still reads the last whole file."""
    a = np.arange(6, dtype=np.float32)
    write_cache_file(tmp_path, {"fingerprint": FINGERPRINT}, [spec("a", a)])
    (tmp_path / ".prefix_cache.k1ll3d.tmp").write_bytes(b"QNEXT partial")
    with caplog.at_level(logging.INFO, logger="qnext.cache"):
        f = read_cache_file(tmp_path, FINGERPRINT)
    assert np.array_equal(f.array("a"), a)
    f.close()
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]
    assert "interrupted write" in caplog.text


@pytest.mark.parametrize("part, value, reason", [("weights", "other", "the model's weights differ"),
                                                 ("block_size", 32, "block_size 16 != 32"),
                                                 ("dtype", "bfloat16", "dtype 'float32' != 'bfloat16'"),
                                                 ("layout_version", 2, "layout_version 1 != 2")])
def test_a_file_for_another_fingerprint_is_ignored_naming_what_differs(tmp_path, caplog, part, value, reason):
    write_cache_file(tmp_path, {"fingerprint": FINGERPRINT}, [spec("a", np.zeros(3, np.float32))])
    with caplog.at_level(logging.WARNING, logger="qnext.cache"):
        assert read_cache_file(tmp_path, {**FINGERPRINT, part: value}) is None
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()


@pytest.mark.parametrize("damage, reason", [(lambda d: d[:20], "truncated"), (lambda d: b"", "empty"),
                                            (lambda d: d[:30] + bytes([d[30] ^ 1]) + d[31:], "header is corrupted"),
                                            (lambda d: d[:-40] + bytes([d[-40] ^ 1]) + d[-39:], "data is corrupted"),
                                            (lambda d: d + b"\0", "extra bytes")])
def test_a_damaged_file_is_ignored_with_one_warning(tmp_path, caplog, damage, reason):
    write_cache_file(tmp_path, {"fingerprint": FINGERPRINT}, [spec("a", np.arange(64, dtype=np.float32))])
    path = tmp_path / FILE_NAME
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="qnext.cache"):
        assert read_cache_file(tmp_path, FINGERPRINT) is None
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()


def make(host_blocks=64, host_snaps=8):
    return CacheManager(CacheConfig(block_size=BS, num_blocks=16, num_live_slots=2, num_snapshot_slots=4,
                                    num_host_blocks=host_blocks, num_host_snapshot_slots=host_snaps))


def test_an_index_moves_to_a_fresh_cache_host_tier_and_serves_hits_there():
    old = make()
    run(old, "a", list(range(17)))
    run(old, "b", list(range(100, 121)))
    old.evict_cached_blocks(2)                                  # some blocks in each tier
    index = index_from_arrays(BS, index_arrays(export_index(old)))
    assert index.num_blocks == 9 and index.num_snapshots == 2
    new = make()
    block_slots, snapshot_slots = import_index(new, index)
    assert None not in block_slots and None not in snapshot_slots
    for sid, prompt in (("c", list(range(17))), ("d", list(range(100, 121)))):
        adm = new.admit(sid, prompt)
        assert adm.num_cached_tokens == 16 + 4 * (sid == "d") and adm.restore_row == adm.state_row
    assert new.stats.tiers.blocks_from_disk == 9 and new.stats.tiers.host_hit_tokens == 36


def test_an_index_larger_than_the_host_tier_keeps_whole_prefixes_most_recent_first():
    old = make()
    run(old, "a", list(range(17)))                              # 4 blocks, older
    run(old, "b", list(range(100, 121)))                        # 5 blocks, newer
    new = make(host_blocks=6, host_snaps=1)
    block_slots, snapshot_slots = import_index(new, export_index(old))
    assert sum(s is not None for s in block_slots) == 6         # b's whole chain, then what fits of a's: its first
    assert new.admit("d", list(range(100, 121))).num_cached_tokens == 20
    adm = new.admit("c", list(range(17)))                       # a's snapshot went with its terminal block
    assert (adm.kv_matched_tokens, adm.num_cached_tokens) == (4, 0)


def test_the_weights_digest_is_remembered_by_file_size_and_time(tmp_path):
    from cache.fingerprint import files_digest, files_digest_memoized

    weights, memo = tmp_path / "model.safetensors", tmp_path / "cache" / "digest.json"
    weights.write_bytes(b"a" * 1000)
    first = files_digest_memoized([weights], memo)
    assert first == files_digest([weights]) and memo.is_file()
    stat = weights.stat()
    weights.write_bytes(b"b" * 1000)                    # same size, same time: the memo answers without reading
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert files_digest_memoized([weights], memo) == first
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))    # a rewrite moves the time: read again
    assert files_digest_memoized([weights], memo) == files_digest([weights]) != first
    memo.write_text("{not json")
    assert files_digest_memoized([weights], memo) == files_digest([weights])
