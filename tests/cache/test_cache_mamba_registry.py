from cache import MambaPrefixRegistry

H = [bytes([i]) * 16 for i in range(5)]  # chain hashes of depths 1..5
BLOCKS = [11, 12, 13, 14, 15]


def test_capture_ties_hash_to_terminal_block_and_eviction_drops_exactly_that_depth():
    reg = MambaPrefixRegistry()
    reg.capture_mamba_prefix_state(H[1], BLOCKS[1])
    reg.capture_mamba_prefix_state(H[3], BLOCKS[3])
    assert reg.mamba_prefix_hashes_by_block == {12: {H[1]}, 14: {H[3]}}
    assert reg.handle_mamba_prefix_evicted_blocks([15, 14]) == [H[3]]
    assert reg.valid_mamba_prefix_hashes == {H[1]}
    # the shallower snapshot is still usable: lookup falls back to depth 2
    assert reg.resolve_mamba_matched_blocks(H[:4], BLOCKS[:4], lambda h: True) == 2


def test_resolve_picks_the_deepest_valid_resident_depth():
    reg = MambaPrefixRegistry()
    for d in (0, 2, 4):
        reg.capture_mamba_prefix_state(H[d], BLOCKS[d])
    assert reg.resolve_mamba_matched_blocks(H, BLOCKS, lambda h: True) == 5
    assert reg.resolve_mamba_matched_blocks(H[:4], BLOCKS[:4], lambda h: True) == 3
    assert reg.resolve_mamba_matched_blocks(H[:1], BLOCKS[:1], lambda h: True) == 1
    assert reg.resolve_mamba_matched_blocks([], [], lambda h: True) == 0


def test_snapshot_evicted_by_the_pool_is_detected_invalidated_and_trimmed():
    reg = MambaPrefixRegistry()
    reg.capture_mamba_prefix_state(H[0], BLOCKS[0])
    reg.capture_mamba_prefix_state(H[2], BLOCKS[2])
    assert reg.resolve_mamba_matched_blocks(H[:3], BLOCKS[:3], lambda h: h != H[2]) == 1
    assert reg.valid_mamba_prefix_hashes == {H[0]} and 13 not in reg.mamba_prefix_hashes_by_block


def test_hash_tied_to_a_different_block_than_matched_is_not_used():
    reg = MambaPrefixRegistry()
    reg.capture_mamba_prefix_state(H[1], 99)
    assert reg.resolve_mamba_matched_blocks(H[:2], BLOCKS[:2], lambda h: True) == 0
    assert not reg.valid_mamba_prefix_hashes


def test_recapture_moves_the_association_and_clear_drops_all():
    reg = MambaPrefixRegistry()
    reg.capture_mamba_prefix_state(H[0], 11)
    reg.capture_mamba_prefix_state(H[0], 21)
    assert reg.mamba_prefix_hashes_by_block == {21: {H[0]}}
    assert reg.handle_mamba_prefix_evicted_blocks([11]) == []
    assert reg.handle_mamba_prefix_evicted_blocks([21]) == [H[0]]
    reg.capture_mamba_prefix_state(H[1], 12)
    assert reg.clear() == [H[1]] and not reg.valid_mamba_prefix_hashes and not reg.mamba_prefix_hashes_by_block
