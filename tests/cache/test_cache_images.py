"""The prefix cache with pictures: blocks key on each image's content hash and offset, a snapshot waits before each
`<|vision_start|>`, and the encoder cache keeps tower outputs by content hash within its byte budget."""
import hashlib

import pytest

from cache import CacheConfig, CacheManager, block_hashes
from cache.encoder_cache import EncoderCache
from cache.image_keys import ImageSpan

BS, VS, VE, PAD = 4, 900, 901, 902


def sha(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def prompt_with_image(text_before: int, image: str, n_pad: int = 9, text_after: int = 6):
    """Text, <|vision_start|>, n_pad placeholders, <|vision_end|>, text; and the image's span."""
    tokens = list(range(1, text_before + 1)) + [VS] + [PAD] * n_pad + [VE] + list(range(50, 50 + text_after))
    return tokens, [ImageSpan(text_before + 1, n_pad, sha(image))]


def run_prompt(m: CacheManager, sid, tokens, images):
    """Admit, run the whole prompt with its planned captures, and finish: what an engine does with it."""
    adm = m.admit(sid, tokens, images=images)
    for p in m.capture_positions(sid):
        m.reserve_capture(sid, p)
    m.commit(sid, tokens, len(tokens))
    m.free(sid, tokens, len(tokens))
    return adm


def manager() -> CacheManager:
    return CacheManager(CacheConfig(block_size=BS, num_blocks=64, num_live_slots=4, num_snapshot_slots=16))


def test_same_text_other_image_reuses_the_text_up_to_the_boundary_before_vision_start():
    m = manager()
    tokens, cat = prompt_with_image(9, "cat")
    run_prompt(m, "a", tokens, cat)
    _, dog = prompt_with_image(9, "dog")
    adm = run_prompt(m, "b", tokens, dog)            # identical token ids, another picture
    assert adm.num_cached_tokens == 9 // BS * BS == 8  # the snapshot at the boundary before <|vision_start|> (pos 9)
    assert adm.kv_matched_tokens == 8                 # no block holding the other picture's tokens matched


def test_same_image_reuses_the_whole_prefix():
    m = manager()
    tokens, cat = prompt_with_image(9, "cat")
    run_prompt(m, "a", tokens, cat)
    adm = run_prompt(m, "b", tokens + [70, 71, 72, 73, 74], cat)
    assert adm.num_cached_tokens == len(tokens) // BS * BS


def test_same_picture_at_another_offset_keys_differently():
    tokens, cat = prompt_with_image(8, "cat", n_pad=8)
    shifted = [ImageSpan(cat[0].start + 1, 7, cat[0].content_hash)]
    assert block_hashes(tokens, BS, images=cat)[2:] != block_hashes(tokens, BS, images=shifted)[2:]


def test_text_blocks_hash_as_without_images():
    tokens, cat = prompt_with_image(9, "cat")
    with_images, text_only = block_hashes(tokens, BS, images=cat), block_hashes(tokens, BS)
    assert with_images[:2] == text_only[:2]           # blocks 0-1 hold no image token
    assert all(a != b for a, b in zip(with_images[2:], text_only[2:]))   # every later block chains through it


def test_a_short_content_hash_is_refused():
    with pytest.raises(ValueError, match="full SHA-256"):
        ImageSpan(0, 4, b"\x12\x34")


def test_a_span_outside_the_prompt_is_refused():
    m = manager()
    with pytest.raises(ValueError, match="inside the 5-token prompt"):
        m.admit("a", [1, 2, 3, 4, 5], images=[ImageSpan(3, 4, sha("cat"))])


def test_encoder_cache_keeps_the_most_recent_outputs_within_its_budget():
    cache = EncoderCache(budget_bytes=100)
    cache.put(sha("a"), "A", 40)
    cache.put(sha("b"), "B", 40)
    assert cache.get(sha("a")) == "A"                 # a is now the most recent
    cache.put(sha("c"), "C", 40)                      # over budget: b, the least recent, goes
    assert sha("b") not in cache and cache.get(sha("c")) == "C" and cache.get(sha("a")) == "A"
    assert cache.stats.bytes_in_use == 80 and cache.stats.evictions == 1
    assert cache.get(sha("b")) is None and cache.stats.misses == 1 and cache.stats.hits == 3
    cache.put(sha("huge"), "H", 101)                  # larger than the budget: not kept, nothing evicted
    assert sha("huge") not in cache and len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.stats.bytes_in_use == 0
