"""Deterministic replays of cache bookkeeping bugs that the random state machine (support/cache_machine.py) found."""
import pytest

from cache import CacheConfig, CacheManager, hash_block_tokens

BS = 2


def _parent_blind_hash(parent_hash, token_ids):
    return bytes(token_ids)


@pytest.mark.parametrize("hash_fn", [hash_block_tokens, _parent_blind_hash], ids=["chained", "parent_blind"])
def test_a_sequence_running_across_a_clear_does_not_hang_a_shared_block_under_its_private_twin(hash_fn):
    """b's first two blocks are twins of a's (both prefilled before either committed); b's own third block is
    published under a's originals and c shares that chain. After a clear, b used to re-publish its own block table:
    its shared third block under its private twin, which c does not hold. Once b was freed, that twin was an
    unreferenced cached block with a referenced child: counted as available but never evictable, so an allocation
    of every available block failed half-way. Now a sequence admitted across a clear publishes nothing more."""
    m = CacheManager(CacheConfig(block_size=BS, num_blocks=12, num_live_slots=3, num_snapshot_slots=0,
                                 hybrid=False), block_hash_fn=hash_fn)
    prompt = [1, 2, 3, 4, 5]
    assert m.admit("a", prompt).num_cached_tokens == 0
    assert m.admit("b", prompt).num_cached_tokens == 0
    m.commit("a", prompt, 5)
    m.commit("b", prompt, 5)                          # b's blocks 0, 1 are twins of a's
    b_tokens = prompt + [6, 7]
    assert m.append_slots("b", 6)
    m.commit("b", b_tokens, 6)                        # b's own block 2, published under a's block 1
    own = m.block_table("b")[2]
    c = m.admit("c", b_tokens)
    assert c.num_cached_tokens == 6 and c.block_table[2] == own
    m.free("a", prompt + [9], 5)
    m.clear_prefix_cache()
    assert m.append_slots("b", 7)
    m.commit("b", b_tokens, 7)
    m.free("b", b_tokens, 7)
    assert m.blocks.num_cached == 0
    pool = m.blocks
    for block_id in m.block_table("c"):               # c holds the whole chain above every cached block it holds
        parent = pool.parent_of(block_id)
        assert parent is None or pool.ref_count(parent), (block_id, parent)
    available = m.num_free_blocks
    assert m.admit("d", list(range(100, 100 + 2 * available))) is not None   # every available block, exactly
    assert m.blocks.num_available == 0


def test_a_fork_made_after_a_clear_publishes_nothing_either():
    """The fork shares its parent's pre-clear block table (and its twins): it may not re-publish it."""
    m = CacheManager(CacheConfig(block_size=BS, num_blocks=16, num_live_slots=3, num_snapshot_slots=0, hybrid=False))
    prompt = [1, 2, 3, 4, 5]
    m.admit("a", prompt, num_forks=1)
    m.commit("a", prompt, 5)
    m.clear_prefix_cache()
    m.fork("a", "b")
    tokens = prompt + [6, 7, 8]
    for sid in "ab":
        assert m.append_slots(sid, 8)
        m.commit(sid, tokens, 8)
    assert m.blocks.num_cached == 0
    m.free("a", tokens, 8)
    m.free("b", tokens, 8)
    assert m.blocks.num_cached == 0 and m.blocks.num_used == 0
    assert m.admit("c", prompt).num_cached_tokens == 0
