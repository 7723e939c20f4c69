"""The cache with a host tier under the random interleavings of tests/support/cache_machine.py, against a simulated
device *and* host that run the queued copies exactly as cache/device_buffers.py does (phase by phase, saves then
loads) at the points where the engine runs them: before a step writes anything. After every step nothing stale is
matchable or restorable in either tier, each valid snapshot's terminal block is resident in some tier, and every
admission reads exactly its prefix, also when the KV and the state come back from the host tier."""
from hypothesis import Phase, event, settings, strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from cache import CacheConfig, CacheManager, block_hashes, hash_block_tokens
from cache.tiers import HOST
from tests.support.cache_machine import (BS, CacheMachine, Seq, image_spans, image_tokens, parent_blind_hash,
                                         token_ids, whole_images)


class TieredCacheMachine(CacheMachine):
    @initialize(num_blocks=st.integers(4, 8), live=st.integers(1, 3), snaps=st.integers(0, 3),
                host_blocks=st.sampled_from([0, 3, 8, 16]), host_snaps=st.integers(0, 6), hybrid=st.booleans(),
                weak_hash=st.booleans())
    def setup_tiers(self, num_blocks, live, snaps, host_blocks, host_snaps, hybrid, weak_hash):
        self.cfg = CacheConfig(block_size=BS, num_blocks=num_blocks, num_live_slots=live, num_snapshot_slots=snaps,
                               hybrid=hybrid, checkpoint_interval=4, num_host_blocks=host_blocks,
                               num_host_snapshot_slots=host_snaps)
        self.hash_fn = parent_blind_hash if weak_hash else hash_block_tokens
        self.m = CacheManager(self.cfg, block_hash_fn=self.hash_fn)
        self.seqs, self.history, self.next_id = {}, [()], 0
        self.kv, self.state = {}, {}            # device: block / row -> the token prefix it really holds
        self.host_kv, self.host_state = {}, {}  # host: slot -> the token prefix it really holds

    # the base machine's own initialize rule is replaced by setup_tiers
    setup = None

    # ---- simulated copies (what the engine does before a step) ------------------------------------------------------
    def _run_transfers(self):
        for phase in self.m.take_transfers().phases:
            for slot, block in phase.kv_saves.items():
                self.host_kv[slot] = self.kv.get(block)
            for slot, row in phase.state_saves.items():
                self.host_state[slot] = self.state.get(row)
            for block, slot in phase.kv_loads.items():
                self.kv[block] = self.host_kv[slot]
            for row, slot in phase.state_loads.items():
                self.state[row] = self.host_state[slot]

    def _write_kv(self, sid, start, end):
        self._run_transfers()
        super()._write_kv(sid, start, end)

    # ---- rules ------------------------------------------------------------------------------------------------------
    def _stem(self, base, cut):
        stems = self.history + [tuple(s.tokens) for s in self.seqs.values()]
        return whole_images(stems[base % len(stems)][:cut])

    @rule(requests=st.lists(st.tuples(st.integers(0, 1000), st.one_of(st.just(99), st.integers(0, 12)),
                                      st.lists(st.integers(0, 2), max_size=7), st.booleans(),
                                      st.one_of(st.none(), st.integers(0, 2))), min_size=1, max_size=3))
    def admit_several(self, requests):
        """Several admissions in one schedule (some rolled back at once), their copies run together."""
        self._admit_batch([(self._stem(base, cut) + (image_tokens(image) if image is not None else []) + ext,
                            roll_back) for base, cut, ext, roll_back, image in requests])

    @precondition(lambda self: len(self.m.tier.blocks))
    @rule(pick=st.integers(0, 1000), ext=st.lists(st.integers(0, 2), max_size=3), roll_back=st.booleans())
    def revisit_offloaded(self, pick, ext, roll_back):
        """A prompt through a block held in the host tier (what it really holds), plus a few tokens."""
        self._run_transfers()
        entries = sorted(self.m.tier.blocks.entries(), key=lambda e: e.uid)
        self._admit_batch([(whole_images(self.host_kv[entries[pick % len(entries)].slot]) + ext, roll_back)])

    def _admit_batch(self, prompts):
        admitted = []
        for prompt, roll_back in prompts:
            prompt = prompt or [0]
            if not self.m.num_free_slots:
                self.free(0)
            sid = self.next_id
            self.next_id += 1
            adm = self.admit_prompt(sid, prompt)
            if adm is None:
                continue
            if roll_back:
                self.m.free(sid, token_ids(prompt), adm.num_cached_tokens)
            else:
                self.seqs[sid] = Seq(prompt, adm)
                admitted.append((sid, prompt, adm))
        self._run_transfers()
        for sid, prompt, adm in admitted:
            if sid not in self.seqs:      # finished by a later admission of the batch, for its slot
                continue
            c = adm.num_cached_tokens
            assert c % BS == 0 and c <= len(prompt) - 1 and c <= adm.kv_matched_tokens
            for i in range(c // BS):
                assert self.kv.get(adm.block_table[i]) == tuple(prompt[:(i + 1) * BS])
            if c and self.cfg.hybrid:
                assert self.state[adm.restore_row] == tuple(prompt[:c])
                if adm.restore_row == adm.state_row:
                    event("state restored from the host tier")
            if self.m._seqs[sid].host_tokens:
                event("KV loaded from the host tier")

    admit = None   # replaced by admit_several

    # ---- invariants -------------------------------------------------------------------------------------------------
    @invariant()
    def blocks_exact(self):
        self._run_transfers()         # the next step would run them first
        super().blocks_exact()

    @invariant()
    def host_blocks_exact(self):
        tier = self.m.tier
        if len(tier.blocks):
            event("host tier holds blocks")
        if self.m.blocks.num_cached:
            event("device holds blocks")
        if self.m.stats.kv_blocks_evicted:
            event("device evicted")
        for e in tier.blocks.entries():   # a host block really holds the prefix its hash names, under a resident parent
            prefix = self.host_kv[e.slot]
            assert len(prefix) % BS == 0 and tuple(token_ids(prefix[-BS:])) == tuple(e.token_ids)
            assert block_hashes(token_ids(prefix), BS, self.hash_fn, image_spans(prefix))[-1] == e.hash
            if e.parent_uid is None:
                assert len(prefix) == BS
            else:
                parent = tier.blocks.by_uid(e.parent_uid)
                on_device = [b for b, p in tier.device_blocks().items() if p.uid == e.parent_uid]
                assert (parent is not None) != bool(on_device)
                held = self.host_kv[parent.slot] if parent is not None else self.kv[on_device[0]]
                assert held == prefix[:-BS]
        assert set(tier.device_blocks()) == set(self.m.blocks._by_hash.values())

    @invariant()
    def snapshots_exact(self):
        self._run_transfers()
        snaps, reg, tier = self.m.snapshots, self.m.registry, self.m.tier
        registered = snaps.registered()
        on_host = dict(tier.snapshots.items())
        assert not set(registered) & set(on_host)            # exclusive tiers
        assert set(reg.valid_mamba_prefix_hashes) == set(reg.mamba_prefix_block_by_hash)
        assert set(reg.valid_mamba_prefix_hashes) == set(registered) | set(on_host)
        for h in reg.valid_mamba_prefix_hashes:              # valid => terminal block resident in some tier
            terminal = reg.mamba_prefix_block_by_hash[h]
            if isinstance(terminal, tuple):
                assert terminal[0] == HOST
                entry = tier.blocks.by_uid(terminal[1])
                assert entry is not None and entry.hash == h
                kv = self.host_kv[entry.slot]
            else:
                assert self.m.blocks.cached_block(h) == terminal
                kv = self.kv[terminal]
            state = self.state[registered[h]] if h in registered else self.host_state[on_host[h]]
            assert state == kv
        pending = [r for sid in self.seqs for r in self.m._seqs[sid].pending_captures.values()]
        decode = [self.m._seqs[sid].decode_row for sid in self.seqs if self.m._seqs[sid].decode_row is not None]
        assert sorted(pending + decode) == sorted(snaps._reserved)
        rows = list(snaps._free) + list(registered.values()) + list(snaps._doomed) + list(snaps._reserved)
        assert sorted(rows) == list(snaps.rows)


TieredCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                                  phases=[p for p in Phase if p is not Phase.explain])
TestTieredCacheMachine = TieredCacheMachine.TestCase
