"""A small CacheManager and the engine's call sequence for one request (admit, prefill with captures, decode,
free), shared by the cache tests."""
from cache import CacheConfig, CacheManager

BS = 4


def make(num_blocks=64, live=4, snaps=8, **kw):
    return CacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks, num_live_slots=live,
                                    num_snapshot_slots=snaps, **kw))


def prefill(m, sid, prompt):
    """Admit and prefill like the engine: cut at each capture position, capture there, commit every chunk."""
    adm = m.admit(sid, prompt)
    assert adm is not None
    done = adm.num_cached_tokens
    for p in m.capture_positions(sid):
        m.reserve_capture(sid, p)
        m.commit(sid, prompt, p)
        done = p
    if done < len(prompt):
        m.commit(sid, prompt, len(prompt))
    return adm


def run(m, sid, prompt, output=()):
    """Prefill, decode `output` (capturing at every block boundary), free. Returns (admission, all tokens)."""
    adm = prefill(m, sid, prompt)
    tokens = list(prompt)
    for tok in output:
        tokens.append(tok)  # sampled; computed by the next decode step
        computed = len(tokens) - 1
        if len(tokens) == len(prompt) + len(output):
            break  # the last sampled token is never computed
        assert m.append_slots(sid, computed + 1)
        if (computed + 1) % BS == 0:
            m.decode_capture_row(sid, computed + 1)
        m.commit(sid, tokens, computed + 1)
    m.free(sid, tokens, len(tokens) - 1 if output else len(prompt))
    return adm, tokens
