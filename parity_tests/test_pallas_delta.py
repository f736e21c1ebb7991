"""Pallas delta-rule kernels (chunk / fused_recurrent of delta_rule and gated_delta_rule): the
cases that test_ops.py's CPU kernel subset leaves out, as a case list on the shared harness
(cases.Case / make_inputs, harness.check: the float64 oracle, jax_runner under jax.jit with
traced cu_seqlens, cases.rel_rms and the one tolerance table).

Covered here: grouped value heads with K != V, odd head sizes (K = 12, V = 20), varlen with an
empty and a 3-token sequence and sequences over several chunks, l2-normalised q / k or not, no
initial state, beta in (0, 2) with gates to -20 (negative eigenvalues), beta near 1, every case
in fp32 / bf16 / fp16 (interpreted on CPU: fp32 and one of bf16 / fp16 per row,
cases.interpreted_dtypes); fp32 dg under gates in [-20, -1] and [-20, -10] over several chunks,
fp16 dh0 with every gate in [-20, -10]; the chunk backward kept chunk-parallel (never the
token-serial one unless asked for with backward="recurrent", which matches too), every chunk
length the tile table may pick, and traced against eager cu_seqlens. Interpreted Pallas outputs
start NaN-filled, so an unwritten element fails. With a GPU backend the same rows run the
compiled kernels.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.common.engine import launch, scalar_delta
from fla_jax.ops.gated_delta_rule import pallas_chunk

from .cases import CASES, OPS, interpreted_dtypes, make_inputs, rel_rms, seed_of, tolerance
from .harness import assert_passed, check

ALL = ("fp32", "bf16", "fp16")
PALLAS = {"jax": "pallas"}
OPS_DR = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_delta_rule",
          "fused_recurrent_delta_rule")
SMALL = ("dr_gqa_l2_no_h0", "dr_varlen_small", "dr_neg_eig_strong", "dr_multi_chunk_varlen",
         "dr_odd_dims")


def _param(op, case, dtype):
    return pytest.param(op, case, dtype, id=f"{op}-{case}-{dtype}")


# test_ops.py's kernel subset already runs basic (bf16), varlen / beta_edges /
# uniform_strong (fp32), gqa_l2_beta2 (bf16) and short_strong (fp16) for all four ops.
ROWS = [_param(op, c, d) for i, op in enumerate(OPS_DR) for j, c in enumerate(SMALL)
        for d in interpreted_dtypes(i + j, ALL)]
ROWS += [_param("chunk_gated_delta_rule", "dr_strong_multi_chunk", d) for d in ("fp32", "bf16")]
ROWS += [_param("chunk_gated_delta_rule", c, "fp32")
         for c in ("dr_strong_long_beta1", "dr_uniform_strong_long")]
ROWS += [_param("fused_recurrent_gated_delta_rule", "dr_strong_long_beta1", "fp32"),
         _param("chunk_gated_delta_rule", "dr_uniform_strong_k64", "fp16")]


@pytest.mark.parametrize("op,case,dtype", ROWS)
def test_delta_pallas(op, case, dtype):
    assert_passed(check(op, case, dtype, PALLAS))


@pytest.fixture
def no_recurrent_backward(monkeypatch):
    """Make the token-serial backward kernel unusable from the chunk op."""
    def forbidden(*args, **kwargs):
        raise AssertionError("chunk backward called the token-serial recurrent backward")

    monkeypatch.setattr(pallas_chunk, "recurrent_backward", forbidden)


@pytest.fixture
def recurrent_backward_requested(monkeypatch):
    """chunk_gated_delta_rule(impl='pallas') called with backward='recurrent'."""
    fn = functools.partial(pallas_chunk.chunk_gated_delta_rule_pallas, backward="recurrent")
    monkeypatch.setattr(pallas_chunk, "chunk_gated_delta_rule_pallas", fn)


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_delta_rule"])
def test_chunk_backward_is_chunk_parallel(no_recurrent_backward, op):
    assert_passed(check(op, "dr_varlen_small", "fp32", PALLAS))


def test_chunk_backward_recurrent_fallback(no_recurrent_backward, recurrent_backward_requested):
    """backward="recurrent" still selects the token-serial kernel (and only it is spied)."""
    with pytest.raises(AssertionError, match="token-serial"):
        check("chunk_gated_delta_rule", "dr_odd_dims", "fp32", PALLAS)


def test_chunk_backward_fallback_parity(recurrent_backward_requested):
    assert_passed(check("chunk_gated_delta_rule", "dr_multi_chunk_varlen", "fp32", PALLAS))


@pytest.mark.parametrize("bt", [16, 32, 64])
def test_chunk_every_chunk_length(monkeypatch, bt):
    """Every chunk length the tile table (engine launch.delta_tiles) may pick: same parity."""
    forced = launch.DeltaTiles(BT=bt, state=(16, 4, 1), dh=(16, 4, 1), grads=(16, 4), wy=(4, 1))
    monkeypatch.setattr(scalar_delta, "delta_tiles", lambda K, V, dtype: forced)
    assert_passed(check("chunk_gated_delta_rule", "dr_multi_chunk_varlen", "fp32", PALLAS))


def test_chunk_backward_traced_cu_seqlens():
    """Gradients under jax.jit with cu_seqlens traced equal the eager ones within the fp32 row
    of the table and 1e-5 (fp32, varlen with an empty sequence, beta in (0, 2), l2norm)."""
    spec, case = OPS["chunk_gated_delta_rule"], CASES["dr_varlen_l2"]
    x = make_inputs(spec, case, seed_of("traced", case.name))
    names = ("q", "k", "v", "g", "beta", "h0")
    args = [jnp.asarray(x[n], jnp.float32) for n in names]
    cu = jnp.asarray(case.cu_seqlens, jnp.int32)

    def loss(q, k, v, g, beta, h0, cu):
        o, ht = pallas_chunk.chunk_gated_delta_rule_pallas(
            q, k, v, g=g, beta=beta, scale=case.K ** -0.5, initial_state=h0,
            output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        return jnp.sum(o * o) + jnp.sum(jnp.sin(ht))

    grad = jax.grad(loss, argnums=tuple(range(len(names))))
    eager = grad(*args, cu)
    traced = jax.jit(grad)(*args, cu)
    errs = {n: rel_rms(np.asarray(b), np.asarray(a), np.asarray(a))
            for n, a, b in zip(names, eager, traced)}
    bad = {n: e for n, e in errs.items() if not e <= min(tolerance("fp32", "d" + n), 1e-5)}
    assert not bad, errs
