"""FreeList (cache/free_list.py), the free ids of every pool in cache/: the order ids come back in is what makes a
run reproducible, and a pool that takes from an empty list must evict first."""
import pytest

from cache.free_list import FreeList


def test_stack_hands_out_the_initial_ids_in_order_then_the_most_recently_freed():
    free = FreeList([4, 5, 6])
    assert [free.take(), free.take()] == [4, 5]
    free.put(4)
    free.put(5)
    assert [free.take(), free.take(), free.take()] == [5, 4, 6]
    assert len(free) == 0


def test_queue_hands_out_the_longest_free_first():
    free = FreeList([1, 2, 3], fifo=True)
    taken = [free.take(), free.take()]
    free.put(taken[1])
    free.put(taken[0])
    assert [free.take(), free.take(), free.take()] == [3, 2, 1]


def test_reset_frees_every_id_in_the_initial_order_and_an_empty_list_refuses():
    free = FreeList(range(3))
    free.take()
    free.reset()
    assert list(free) == [0, 1, 2]
    for _ in range(3):
        free.take()
    with pytest.raises(IndexError, match="evict first"):
        free.take()
