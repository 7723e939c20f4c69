"""The cache under random interleavings of admit / step (prefill, capture, decode) / finish / abort / evict / clear
against a simulated device that records what every KV block and state row really holds (a hypothesis state
machine). tests/cache/test_cache_properties.py runs it; tests/cache/test_cache_tier_properties.py extends it with a
host tier.

Prompts may hold images: a token is an int, or an image placeholder (PAD, content hash, index in the image, image
length), so the simulated device knows which picture every block and state really saw. The manager gets the ids
and the spans; a stale image (the same ids, another picture) matched or restored fails the invariants."""
import hashlib
from collections import Counter

from hypothesis import event, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache import CacheConfig, CacheManager, block_hashes, hash_block_tokens
from cache.image_keys import ImageSpan

BS = 2
VISION_START, VISION_END, PAD = 3, 4, 5


def image_tokens(image: int) -> list[tuple]:
    """Picture `image`'s placeholder tokens (its size is part of its content: 2 + image tokens)."""
    digest, n = hashlib.sha256(bytes([image])).digest(), 2 + image
    return [VISION_START] + [(PAD, digest, i, n) for i in range(n)] + [VISION_END]


def token_ids(tokens) -> list[int]:
    return [t if isinstance(t, int) else t[0] for t in tokens]


def image_spans(tokens) -> list[ImageSpan]:
    return [ImageSpan(p, t[3], t[1]) for p, t in enumerate(tokens) if not isinstance(t, int) and t[2] == 0]


def whole_images(tokens) -> list:
    """tokens without a trailing image cut short (a prompt holds whole pictures)."""
    tokens = list(tokens)
    if tokens and not isinstance(tokens[-1], int) and tokens[-1][2] != tokens[-1][3] - 1:
        del tokens[len(tokens) - 1 - tokens[-1][2]:]
    return tokens


def parent_blind_hash(parent_hash, token_ids):
    return bytes(token_ids)


class Seq:
    def __init__(self, tokens, adm):
        self.tokens = list(tokens)
        self.prompt_len = len(tokens)
        self.computed = adm.num_cached_tokens
        self.adm = adm


class CacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), live=st.integers(1, 3), snaps=st.integers(0, 4),
                hybrid=st.booleans(), interval=st.sampled_from([0, 4, 8192]), weak_hash=st.booleans())
    def setup(self, num_blocks, live, snaps, hybrid, interval, weak_hash):
        self.cfg = CacheConfig(block_size=BS, num_blocks=num_blocks, num_live_slots=live,
                               num_snapshot_slots=snaps, hybrid=hybrid, checkpoint_interval=interval)
        self.hash_fn = parent_blind_hash if weak_hash else hash_block_tokens
        self.m = CacheManager(self.cfg, block_hash_fn=self.hash_fn)
        self.seqs: dict[int, Seq] = {}
        self.history: list[tuple[int, ...]] = [()]
        self.kv = {}      # block -> token prefix whose KV the block really holds (through its last written slot)
        self.state = {}   # snapshot row -> token prefix whose state the row really holds
        self.next_id = 0

    def admit_prompt(self, sid, prompt):
        return self.m.admit(sid, token_ids(prompt), images=image_spans(prompt))

    # ---- simulated device -------------------------------------------------------------------------------------------
    def _write_kv(self, sid, start, end):
        s = self.seqs[sid]
        for pos in range(start, end):
            self.kv[self.m.block_table(sid)[pos // BS]] = tuple(s.tokens[:pos + 1])

    # ---- rules ------------------------------------------------------------------------------------------------------
    @rule(base=st.integers(0, 1000), cut=st.one_of(st.just(99), st.integers(0, 12)),
          ext=st.lists(st.integers(0, 2), max_size=7), image=st.one_of(st.none(), st.integers(0, 2)))
    def admit(self, base, cut, ext, image):
        stems = self.history + [tuple(s.tokens) for s in self.seqs.values()]
        stem = stems[base % len(stems)]
        prompt = whole_images(stem[:cut]) + (image_tokens(image) if image is not None else []) + ext
        if not prompt:
            prompt = [0]
        if not self.m.num_free_slots:  # keep requests flowing: finish the oldest one
            self.free(0)
        sid = self.next_id
        self.next_id += 1
        adm = self.admit_prompt(sid, prompt)
        if adm is None:
            return
        n, c = len(prompt), adm.num_cached_tokens
        assert c % BS == 0 and c <= n - 1 and c <= adm.kv_matched_tokens
        assert len(adm.block_table) == -(-n // BS)
        for i in range(c // BS):  # every shared block really holds this prompt's prefix
            assert self.kv.get(adm.block_table[i]) == tuple(prompt[:(i + 1) * BS])
        if c:
            event("prefix hit")
            if any(span.start < c for span in image_spans(prompt)):
                event("prefix hit through an image")
        if c and self.cfg.hybrid:
            event("state restored")
            assert self.state[adm.restore_row] == tuple(prompt[:c])
        else:
            assert adm.restore_row is None
        positions = self.m.capture_positions(sid)
        assert positions == sorted(positions) and all(p % BS == 0 and c < p <= n for p in positions)
        self.seqs[sid] = Seq(prompt, adm)

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 1000), chunk=st.integers(1, 9), capture=st.booleans(), tok=st.integers(0, 2))
    def step(self, pick, chunk, capture, tok):
        sid = sorted(self.seqs)[pick % len(self.seqs)]
        s = self.seqs[sid]
        if s.computed < s.prompt_len:  # prefill chunk, cut at the next planned capture position
            end = min(s.prompt_len, s.computed + chunk)
            plan = [p for p in self.m.capture_positions(sid) if p > s.computed]
            if plan and plan[0] < end:
                end = plan[0]
            row = self.m.reserve_capture(sid, end) if capture and end in plan else None
            self._write_kv(sid, s.computed, end)
            s.computed = end
            if row is not None:
                self.state[row] = tuple(s.tokens[:end])
            self.m.commit(sid, token_ids(s.tokens), s.computed)
            if s.computed == s.prompt_len:
                s.tokens.append(tok)  # sampled from the last prompt token's logits
            return
        if not self.m.append_slots(sid, s.computed + 1):
            return
        row = None
        if (s.computed + 1) % BS == 0 and capture:
            row = self.m.decode_capture_row(sid, s.computed + 1)
        self._write_kv(sid, s.computed, s.computed + 1)
        s.computed += 1
        if row is not None:
            self.state[row] = tuple(s.tokens[:s.computed])
        self.m.commit(sid, token_ids(s.tokens), s.computed)
        s.tokens.append(tok)

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 1000), steps=st.integers(1, 8), tok=st.integers(0, 2))
    def run_several(self, pick, steps, tok):
        for i in range(steps):
            if self.seqs:
                self.step(pick, 4, True, (tok + i) % 3)

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 1000))
    def free(self, pick):
        sid = sorted(self.seqs)[pick % len(self.seqs)]
        s = self.seqs.pop(sid)
        self.m.free(sid, token_ids(s.tokens), s.computed)
        self.history.append(tuple(s.tokens))

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        self.m.evict_cached_blocks(n)

    @rule(n=st.integers(0, 8))
    def evict_until_free(self, n):
        self.m.evict_until_free(n)

    @rule()
    def clear(self):
        self.m.clear_prefix_cache()
        assert not self.m.registry.valid_mamba_prefix_hashes

    # ---- invariants -------------------------------------------------------------------------------------------------
    @invariant()
    def blocks_exact(self):
        pool = self.m.blocks
        held = Counter()
        for sid in self.seqs:
            table = self.m.block_table(sid)
            assert len(set(table)) == len(table) and 0 not in table
            held.update(table)
            held.update(self.m._twin_originals(self.m._seqs[sid]))  # held while a private twin duplicates them
        for b in range(1, self.cfg.num_blocks):
            assert pool.ref_count(b) == held[b]
            if pool.is_free(b):
                assert held[b] == 0
        assert pool.ref_count(0) == 0 and not pool.is_free(0)
        assert len(set(pool._free)) == len(pool._free) == sum(pool.is_free(b) for b in range(1, self.cfg.num_blocks))
        assert pool.num_used == sum(1 for b in range(1, self.cfg.num_blocks) if held[b])
        for h, b in pool._by_hash.items():  # a cached block really holds the prefix its hash names
            assert pool.block_hash(b) == h
            prefix = self.kv[b]
            assert len(prefix) % BS == 0 and block_hashes(token_ids(prefix), BS, self.hash_fn,
                                                          image_spans(prefix))[-1] == h
            assert pool.block_tokens(b) == tuple(token_ids(prefix[-BS:]))
            tied = self.m.registry.mamba_prefix_hashes_by_block.get(b, ())   # 1: ends a snapshot, 2: a protected one
            assert pool._blocks[b].protected == max((1 + (self.m.snapshots.priority(h) or 0) for h in tied), default=0)
            parent = pool.parent_of(b)
            assert self.kv[parent] == prefix[:-BS] if parent is not None else len(prefix) == BS
            if held[b]:
                assert parent is None or held[parent]
        has_held_descendant = set()
        for b in pool._by_hash.values():
            if held[b]:
                parent = pool.parent_of(b)
                while parent is not None and parent not in has_held_descendant:
                    has_held_descendant.add(parent)
                    parent = pool.parent_of(parent)
        reachable = [b for b in pool._by_hash.values() if not held[b] and b not in has_held_descendant]
        assert pool.num_available == pool.num_free + len(reachable)  # exact: an allocation never fails half-way

    @invariant()
    def snapshots_exact(self):
        snaps, reg = self.m.snapshots, self.m.registry
        registered = snaps.registered()
        assert set(reg.valid_mamba_prefix_hashes) == set(reg.mamba_prefix_block_by_hash)
        assert set(reg.valid_mamba_prefix_hashes) == set(registered)  # no row held by a forgotten snapshot
        for h in reg.valid_mamba_prefix_hashes:  # valid => KV resident and the row holds exactly that prefix
            b = reg.mamba_prefix_block_by_hash[h]
            assert self.m.blocks.cached_block(h) == b and h in reg.mamba_prefix_hashes_by_block[b]
            assert self.state[registered[h]] == self.kv[b]  # the state after exactly the prefix its block holds
        pending = [r for sid in self.seqs for r in self.m._seqs[sid].pending_captures.values()]
        decode = [self.m._seqs[sid].decode_row for sid in self.seqs if self.m._seqs[sid].decode_row is not None]
        rows = list(snaps._free) + list(registered.values()) + list(snaps._doomed)
        assert sorted(pending + decode) == sorted(snaps._reserved)
        rows += list(snaps._reserved)
        assert sorted(rows) == list(snaps.rows)

    @invariant()
    def slots_exact(self):
        rows = [self.m._seqs[sid].state_row for sid in self.seqs] + self.m._free_slots
        assert sorted(rows) == list(range(1, self.cfg.num_live_slots + 1))

    def teardown(self):
        for sid, s in list(self.seqs.items()):
            self.m.free(sid, token_ids(s.tokens), s.computed)
        self.seqs.clear()
        self.blocks_exact()
        self.snapshots_exact()
        assert self.m.blocks.num_used == 0 and self.m.num_free_slots == self.cfg.num_live_slots
        assert self.m.snapshots.num_reserved == 0 and not self.m.snapshots._pins
