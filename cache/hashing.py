"""Chained block hashes: stable across processes (blake2b, not Python's salted `hash`)."""
from array import array
from hashlib import blake2b
from typing import Callable, Sequence

from cache.image_keys import ImageSpan, block_image_keys

HASH_BYTES = 16

BlockHashFn = Callable[[bytes | None, Sequence[int]], bytes]  # (parent hash or None, tokens of one block) -> hash


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """hash(block i) = blake2b(hash(block i-1) || int32 tokens of block i); the first block has no parent."""
    h = blake2b(parent_hash or b"", digest_size=HASH_BYTES)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


def with_image_keys(token_hash: bytes, image_keys: bytes) -> bytes:
    """A block's hash with its images mixed in (cache/image_keys.py): blake2b(token hash || image keys), at full
    strength whatever the token hash function (a weak one in tests must not make two pictures collide)."""
    if not image_keys:
        return token_hash
    return blake2b(token_hash + image_keys, digest_size=HASH_BYTES).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int,
                        hash_fn: BlockHashFn = hash_block_tokens,
                        images: Sequence[ImageSpan] = (), root: bytes | None = None) -> list[bytes]:
    """Append the chain hashes of full blocks len(hashes)..num_blocks-1 of `token_ids` to `hashes` (in place).
    images: the prompt's image spans; each block holding image tokens keys on them too.
    root: the first block's parent (None: none), so that every hash of the chain depends on it: a LoRA adapter's
    weights digest (qnext/lora), so that sequences of different adapters never share a block or a snapshot."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} tokens need {num_blocks * block_size} tokens; "
                         f"got {len(token_ids)}")
    for i in range(len(hashes), num_blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        token_hash = hash_fn(hashes[-1] if hashes else root, token_ids[lo:hi])
        hashes.append(with_image_keys(token_hash, block_image_keys(images, lo, hi)) if images else token_hash)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, hash_fn: BlockHashFn = hash_block_tokens,
                 images: Sequence[ImageSpan] = (), root: bytes | None = None) -> list[bytes]:
    """Chain hashes of every full block of `token_ids` (a partial tail block has no hash); root: as above."""
    return extend_block_hashes([], token_ids, block_size, len(token_ids) // block_size, hash_fn, images, root)
