"""A prompt computed elsewhere (cache/transferred_prompts.py, an object the manager holds): the hold keeps the cached
leading blocks, a dropped hold gives them back, an admission takes the hold over into the sequence's record, and
the holds are the object's own state (a second manager's holds are not the first's)."""
import pytest

from cache import CacheManager
from cache.transferred_prompts import TransferredPrompts
from tests.support.cache_cases import BS, make, run


def test_a_hold_keeps_the_cached_leading_blocks_and_dropping_it_gives_them_back():
    m = make()
    prompt = list(range(3 * BS + 1))
    run(m, "a", prompt)                                  # its full blocks are cached now
    free = m.num_free_blocks
    assert m.transferred.hold("b", prompt) == 3
    assert m.num_free_blocks == free - 3                # referenced: eviction cannot take them
    with pytest.raises(ValueError, match="already held"):
        m.transferred.hold("b", prompt)
    m.transferred.drop("b")
    assert m.num_free_blocks == free and not m.transferred.is_held("b")


def test_an_admission_takes_the_hold_over_and_counts_the_prompt_as_computed():
    m = make()
    prompt = list(range(2 * BS + 2))
    run(m, "a", prompt)
    held = m.transferred.hold("b", prompt)
    with pytest.raises(ValueError, match="must have 1"):
        m.admit_transferred("b", prompt + [7], len(prompt) + 1)
    adm = m.admit_transferred("b", prompt + [7], len(prompt))
    assert adm.num_cached_tokens == len(prompt) and len(adm.block_table) == -(-(len(prompt) + 1) // BS)
    assert not m.transferred.is_held("b") and m.block_table("b") == adm.block_table
    assert m.stats.transferred_tokens == len(prompt) - held * BS
    with pytest.raises(ValueError, match="already held or admitted"):
        m.transferred.hold("b", prompt)


def test_the_holds_are_the_objects_own_state():
    one, two = make(), make()
    assert isinstance(one.transferred, TransferredPrompts) and not isinstance(one, TransferredPrompts)
    one.transferred.hold("x", list(range(BS + 1)))
    assert one.transferred.is_held("x") and not two.transferred.is_held("x")
    assert "_held" not in vars(one)                     # the manager keeps no hold bookkeeping of its own
    assert isinstance(two, CacheManager)
