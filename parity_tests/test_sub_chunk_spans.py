"""gates.sub_chunk_spans / fits_flags (the diagonal-path decisions the Pallas KDA kernels read
instead of testing their cumsums) against a float64 numpy oracle over the slots of varlen.py:
the bound is >= every channel's decay across every sub-chunk (the property the factored
diagonal needs), equal to it where the channels of a group share one gate and g <= 0, and NaN
gates never claim a fit. Fixed-size and varlen (an empty sequence, sequences crossing chunks),
K not a multiple of 16, gates of both signs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.common import pallas_triton as ptr
from fla_jax.ops.common.engine import gates as gt
from fla_jax.ops.common.engine import varlen as vl

BT, SUB = 64, 16


def _true_spans(g, cu):
    """float64 [slots, H, Kp]: per channel, max over the slot's sub-chunks and rows of -loc
    (loc the in-sub-chunk inclusive cumsum), and which slots hold a chunk."""
    g = np.asarray(g, np.float64)
    B, T, H, K = g.shape
    seqs = ([(n, n, 0, T) for n in range(B)] if cu is None
            else [(n, 0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)])
    S = vl.n_slots(T, BT, len(seqs), cu is not None)
    out = np.zeros((S, H, ptr.padded(K)))
    used = np.zeros(S, bool)
    for n, row, bos, eos in seqs:
        first = bos // BT + n if cu is not None else n * vl.n_chunks(T, BT)
        for c in range(-(-(eos - bos) // BT)):
            s = bos + c * BT
            x = np.zeros((BT, H, K))
            x[:min(BT, eos - s)] = g[row, s:min(s + BT, eos)]
            loc = np.cumsum(x.reshape(BT // SUB, SUB, H, K), axis=1)
            out[first + c, :, :K] = np.max(-loc, axis=(0, 1))
            used[first + c] = True
    return out, used


def _spans(g, cu):
    cuj = None if cu is None else jnp.asarray(cu, jnp.int32)

    @jax.jit
    def f(g, cuj):
        seq = None if cuj is None else vl.slot_sequences(cuj, g.shape[1], BT)
        return gt.sub_chunk_spans(g, BT, SUB, cuj is not None, cuj, seq)
    return np.asarray(f(jnp.asarray(g, jnp.float32), cuj), np.float64)


CASES = {"fixed_k40": (2, 150, 2, 40, None), "varlen_k64": (1, 200, 1, 64, (0, 0, 7, 70, 200))}


@pytest.mark.parametrize("case", list(CASES))
def test_spans_bound_every_channel(case):
    B, T, H, K, cu = CASES[case]
    rng = np.random.default_rng(len(case))
    g = rng.uniform(-3.0, 0.5, (B, T, H, K)).astype(np.float32)       # both signs
    got = _spans(g, cu)
    want, used = _true_spans(g, cu)
    G = got.shape[-1]
    assert got.shape == (want.shape[0], H, ptr.padded(K) // gt.GROUP)
    per_group = want.reshape(want.shape[0], H, G, gt.GROUP).max(-1)
    assert np.all(got[used] >= per_group[used] - 1e-4), np.min(got[used] - per_group[used])
    assert np.all(got[~used] == 0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_spans_exact_for_shared_nonpositive_gates(case):
    B, T, H, K, cu = CASES[case]
    rng = np.random.default_rng(3)
    g = np.repeat(-rng.uniform(0.0, 2.0, (B, T, H, 1)).astype(np.float32), K, axis=-1)
    got = _spans(g, cu)
    want, used = _true_spans(g, cu)
    G = got.shape[-1]
    nk = -(-K // gt.GROUP)                              # groups holding real channels
    per_group = want.reshape(want.shape[0], H, G, gt.GROUP).max(-1)
    np.testing.assert_allclose(got[used][..., :nk], per_group[used][..., :nk], rtol=1e-5)


def test_fits_flags_blocks_and_nan():
    B, T, H, K = 1, 128, 1, 64
    g = np.full((B, T, H, K), -0.1, np.float32)          # 1.6 nats per sub-chunk: fits
    g[0, 70, 0, 20] = -30.0                              # slot 1, key group 1: does not
    g[0, 5, 0, 50] = np.nan                              # slot 0, key group 3: NaN
    f16 = np.asarray(gt.fits_flags(jnp.asarray(_spans(g, None), jnp.float32), 16))
    np.testing.assert_array_equal(f16[:, 0], [[1, 1, 1, 0], [1, 0, 1, 1]])
    f32 = np.asarray(gt.fits_flags(jnp.asarray(_spans(g, None), jnp.float32), 32))
    np.testing.assert_array_equal(f32[:, 0], [[1, 0], [0, 1]])
    assert f16.dtype == np.int32
