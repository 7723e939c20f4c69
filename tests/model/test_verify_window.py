"""The verify pass's delta rule over a window (qnext/model/verify.py): its outputs and the state after every
window position equal the token-by-token recurrence the decode step runs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnext.model.verify import delta_rule_window


def _token_by_token(q, k, v, g, beta, state):
    """The decode recurrence, one token at a time: S <- e^g S + k (beta (v - e^g S^T k))^T, o = S^T q."""
    hv = v.shape[2]
    r = hv // q.shape[2]
    q, k = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)
    outs, states = [], []
    s = state.copy()
    for t in range(q.shape[1]):
        decay = np.exp(g[:, t])[..., None, None]                                  # [D, Hv, 1, 1]
        s = decay * s
        delta = beta[:, t][..., None] * (v[:, t] - np.einsum("dhkv,dhk->dhv", s, k[:, t]))
        s = s + k[:, t][..., :, None] * delta[..., None, :]
        outs.append(np.einsum("dhkv,dhk->dhv", s, q[:, t]))
        states.append(s.copy())
    return np.stack(outs, axis=1), states


@pytest.mark.parametrize("length", [1, 4, 9])
def test_window_outputs_and_every_positions_state_equal_the_recurrence(length):
    d, hk, hv, dk, dv = 2, 2, 4, 8, 6
    rng = np.random.default_rng(length)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(d, length, hk, dk))) * dk ** -0.5
    k = unit(rng.normal(size=(d, length, hk, dk)))
    v = rng.normal(size=(d, length, hv, dv))
    g = -rng.uniform(0.01, 2.0, size=(d, length, hv))
    beta = rng.uniform(0.1, 1.0, size=(d, length, hv))
    state = rng.normal(size=(d, hv, dk, dv))
    args = [np.asarray(x, np.float32) for x in (q, k, v, g, beta, state)]
    want_o, want_states = _token_by_token(*[x.astype(np.float64) for x in args])
    o, deltas = jax.jit(delta_rule_window)(*args)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-4, atol=1e-5)
    for j in range(length):
        # rows keep different positions: row 0 position j, row 1 the last one
        keep = jnp.asarray([j, length - 1], jnp.int32)
        got = np.asarray(jax.jit(lambda dl, keep: dl.state_after(keep))(deltas, keep))
        np.testing.assert_allclose(got[0], want_states[j][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got[1], want_states[-1][1], rtol=1e-4, atol=1e-5)
