"""The adapter digest roots the block hash chain: every block of a prompt keys on it (cache/hashing.py)."""
from cache.hashing import block_hashes, extend_block_hashes


def test_every_block_hash_depends_on_the_root():
    tokens = list(range(64))
    base, a, b = (block_hashes(tokens, 16, root=r) for r in (None, b"adapter-a-digest", b"adapter-b-digest"))
    assert len(base) == len(a) == len(b) == 4
    assert all(x != y and x != z and y != z for x, y, z in zip(base, a, b))
    assert block_hashes(tokens, 16, root=b"adapter-a-digest") == a          # the same adapter shares


def test_publishing_extends_a_rooted_chain_from_its_root():
    """A prompt shorter than a block has no hash at admission; the blocks its decode fills get the root too."""
    tokens = list(range(40))
    assert extend_block_hashes([], tokens, 16, 2, root=b"r") == block_hashes(tokens[:32], 16, root=b"r")
    assert extend_block_hashes([], tokens, 16, 2, root=b"r") != block_hashes(tokens[:32], 16)
