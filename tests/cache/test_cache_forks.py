"""Forks in the cache manager (cache/forks.py) and their device copy (cache/device_buffers.py): reserves taken at
admission, the prompt's full blocks shared by reference, the partial block and the state row copied, everything
back where it was after every sequence is freed; the copy against numpy."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cache import CacheConfig, CacheManager
from cache.device_buffers import CacheBuffers
from cache.fork_buffer_copies import apply_fork_copies, warm_up_fork_copies
from qnext.engine.stats import compilations

BS = 4


def make(num_blocks=32, live=4):
    return CacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks, num_live_slots=live, num_snapshot_slots=4))


def test_forks_share_full_blocks_copy_the_partial_one_and_give_everything_back():
    m = make()
    free = (m.num_free_blocks, m.num_free_slots)
    prompt = list(range(10))                                     # 2 full blocks + 2 tokens
    assert m.admit("a", prompt, num_forks=4) is None             # 5 rows needed, 4 live
    adm = m.admit("a", prompt, num_forks=2)
    assert m.num_free_slots == 1 and m.num_free_blocks == free[0] - 3 - 2
    m.commit("a", prompt, len(prompt))
    m.fork("a", "b")
    m.fork("a", "c")
    tables = [m.block_table(s) for s in "abc"]
    assert tables[1][:2] == tables[2][:2] == adm.block_table[:2]        # shared by reference
    assert len({t[2] for t in tables}) == 3                             # partial block: one each
    assert all(m.blocks.ref_count(b) == 3 for b in adm.block_table[:2])
    assert m.state_rows("b") == (m._seq("b").state_row,) * 2          # reads its own row from its first step
    copies = m.take_fork_copies()
    parent_row = m._seq("a").state_row
    assert copies.src_rows == [parent_row] * 2 and sorted(copies.dst_rows) == sorted(
        [m._seq("b").state_row, m._seq("c").state_row])
    assert copies.src_blocks == [adm.block_table[2]] * 2 and sorted(copies.dst_blocks) == sorted(
        [tables[1][2], tables[2][2]])
    for s in "cab":
        m.free(s, prompt, len(prompt))
    assert (m.num_free_blocks, m.num_free_slots) == free and m.blocks.num_used == 0


def test_freeing_before_forking_releases_the_reserves_and_pending_copies():
    m = make()
    free = (m.num_free_blocks, m.num_free_slots)
    prompt = list(range(6))
    m.admit("a", prompt, num_forks=3)
    m.commit("a", prompt, len(prompt))
    m.fork("a", "b")
    m.free("b", prompt, len(prompt))                              # finished with its first token
    assert not m.take_fork_copies()                               # its copies would write freed memory
    m.free("a", prompt, len(prompt))                              # two forks never made
    assert (m.num_free_blocks, m.num_free_slots) == free


def buffers(rows=6, blocks=5):
    rng = np.random.default_rng(0)
    kv = ((jnp.asarray(rng.normal(size=(2, blocks, BS, 3)), jnp.float32),
           jnp.asarray(rng.normal(size=(2, blocks, BS, 3)), jnp.float32)),)
    conv = (jnp.asarray(rng.normal(size=(rows, 3, 5)), jnp.float32).at[0].set(0),)
    rec = (jnp.asarray(rng.normal(size=(rows, 2, 3, 3)), jnp.float32).at[0].set(0),)
    return CacheBuffers(kv=kv, conv=conv, recurrent=rec)


def test_the_device_copy_matches_numpy_and_compiles_nothing_after_warm_up():
    from cache.forks import ForkCopies

    b = warm_up_fork_copies(buffers(), max_forks=4)
    before = jax_tree_numpy(b)
    start = compilations()
    for rows, blocks in (([1, 2, 3], [2, 3, 4]), ([2], []), ([1, 1, 4, 4], [1, 2, 3, 4])):
        dst_rows = [5, 4, 3, 2][:len(rows)]
        dst_blocks = [4, 3, 2, 1][:len(blocks)]
        b = apply_fork_copies(ForkCopies(rows, dst_rows, blocks, dst_blocks), b)
        for arr in before["conv"] + before["recurrent"]:
            arr[dst_rows] = arr[rows]
        for arr in before["kv"]:
            arr[:, dst_blocks] = arr[:, blocks]
        got = jax_tree_numpy(b)
        for key in ("conv", "recurrent", "kv"):
            for g, w in zip(got[key], before[key]):
                np.testing.assert_array_equal(g, w)
    assert compilations() == start
    assert not np.any(jax_tree_numpy(b)["conv"][0][0])             # the zero row stays zero


def jax_tree_numpy(b: CacheBuffers) -> dict:
    return {"conv": [np.array(b.conv[0])], "recurrent": [np.array(b.recurrent[0])],
            "kv": [np.array(b.kv[0][0]), np.array(b.kv[0][1])]}
