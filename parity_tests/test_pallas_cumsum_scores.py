"""The Pallas engine's key-gate front stage `cumsum_scores` (A, qg, kg, el) against a float64
numpy reference, on CPU, interpreted (outputs start NaN-filled, so an unwritten element fails).

Per element, |got - ref| <= rtol * scale + atol, scale the float64 sum of the absolute terms
(A: sum_c |q_ic k_jc| exp(b_ic - b_jc); qg, kg, el: |ref|), so tiny decayed entries are held to
the same relative accuracy as O(1) ones (fp32), up to the 16-bit rounding floor. Cases: weak
gates (the factored diagonal dot), per-channel gates down to -20 (the per-pair fallback),
channels and sub-chunks of both kinds in one call (both branches within one key block loop),
varlen with an empty, a sub-chunk and a multi-chunk sequence, K = 48 / 100 (partial key blocks),
T not a multiple of the chunk; every launch switch (SPLIT, FRAME, DIAG incl. "split" with its
second kernel, key block). Unused varlen slots
must hold A = 0. `test_checker_catches_*`: forcing the factored diagonal under strong gates, or
dropping the varlen row mask, makes the same check fail.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.common import pallas_triton as ptr
from fla_jax.ops.common.engine import Launch
from fla_jax.ops.common.engine import cumsum_scores as cs
from fla_jax.ops.common.engine import output_stage
from fla_jax.ops.common.engine import varlen as vl

from .score_stage import BT, DT, TOL, bounded_mismatch, inputs, run_stage

EL_TOL = (2e-5, 1e-37)


def _gates(kind, rng, shape):
    B, T, H, K = shape
    if kind == "weak":
        return -rng.uniform(0.0, 0.01, (B, T, H, K))
    if kind == "strong":                      # every sub-chunk far past gates.SPAN
        return -rng.uniform(10.0, 20.0, (B, T, H, K))
    # mixed, by sub-chunk of 16 tokens (t // 16 % 3): weak everywhere (the factored diagonal),
    # then channels c % 3 == 0 down to -20 (the per-pair fallback), then channels c % 3 == 1
    # in [-2.5, 0] (about gates.SPAN across a sub-chunk: either branch)
    g = -rng.uniform(0.0, 1.0, (B, T, H, K))
    phase = ((np.arange(T) // 16) % 3)[None, :, None, None]
    c3 = (np.arange(K) % 3)[None, None, None, :]
    g = np.where((phase == 1) & (c3 == 0), -rng.uniform(0.0, 20.0, g.shape), g)
    g = np.where((phase == 2) & (c3 == 1), -rng.uniform(0.0, 2.5, g.shape), g)
    return g


def _inputs(dtype, B, T, H, K, gates, seed):
    return inputs(dtype, B, T, H, K, functools.partial(_gates, gates), seed)


def reference(q, k, g, cu):
    """float64 (A, qg, kg, el, and the scales of A) over the slots of varlen.py; unused slots:
    A = 0 (nothing else is defined there)."""
    q, k, g = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, g))
    B, T, H, K = q.shape
    Kp = ptr.padded(K)
    if cu is None:
        seqs = [(n, n, 0, T) for n in range(B)]
    else:
        seqs = [(n, 0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    S = vl.n_slots(T, BT, len(seqs), cu is not None)
    A, scale = np.zeros((S, H, BT, BT)), np.zeros((S, H, BT, BT))
    el = np.full((S, H, Kp), np.nan)
    el[..., K:] = 1.0
    qg, kg = np.full(q.shape, np.nan), np.full(q.shape, np.nan)
    used = np.zeros(S, bool)
    for n, row, bos, eos in seqs:
        first = bos // BT + n if cu is not None else n * vl.n_chunks(T, BT)
        for c in range(-(-(eos - bos) // BT)):
            s, e = bos + c * BT, min(bos + (c + 1) * BT, eos)
            slot, L = first + c, e - s
            used[slot] = True
            b = np.cumsum(g[row, s:e], axis=0)                          # [L, H, K]
            last = b[-1]
            qg[row, s:e] = q[row, s:e] * np.exp(b)
            kg[row, s:e] = k[row, s:e] * np.exp(last[None] - b)
            el[slot, :, :K] = np.exp(last)
            causal = np.tril(np.ones((L, L), bool))[:, :, None, None]
            gapx = np.where(causal, b[:, None] - b[None, :], -np.inf)  # [i, j, H, K]
            terms = q[row, s:e][:, None] * k[row, s:e][None, :] * np.exp(gapx)
            A[slot, :, :L, :L] = np.transpose(terms.sum(-1), (2, 0, 1))
            scale[slot, :, :L, :L] = np.transpose(np.abs(terms).sum(-1), (2, 0, 1))
    return A, scale, qg, kg, el, used


def run(q, k, g, cu, **kw):
    return run_stage(cs.cumsum_scores, q, k, g, cu, **kw)


def mismatches(got, ref, dtype):
    """{output: (bad element count, worst |err| / (rtol scale + atol))} of the outputs that
    fail their bound (empty: all pass)."""
    A, qg, kg, el = got
    rA, sA, rqg, rkg, rel, used = ref
    out = {}

    def check(name, x, r, s, tol):
        bad = bounded_mismatch(x, r, s, tol)
        if bad:
            out[name] = bad

    assert A.shape == rA.shape and A.dtype == qg.dtype and el.dtype == jnp.float32
    check("A", A, rA, sA, TOL[dtype]["A"])
    check("qg", qg, rqg, np.abs(rqg), TOL[dtype]["x"])
    check("kg", kg, rkg, np.abs(rkg), TOL[dtype]["x"])
    el = np.asarray(el, np.float64)
    check("el", el[used], rel[used], np.abs(rel[used]), EL_TOL)
    if not np.isfinite(el).all():
        out["el unused slots"] = (int((~np.isfinite(el)).sum()), np.inf)
    return out


# (name, B, T, H, K, cu_seqlens, gates)
CASES = {
    "weak_k48": (2, 100, 2, 48, None, "weak"),
    "strong_k100": (1, 130, 2, 100, None, "strong"),
    "mixed_k48": (2, 80, 1, 48, None, "mixed"),
    "varlen_mixed": (1, 160, 2, 48, (0, 0, 5, 70, 150, 160), "mixed"),
    "varlen_strong_k100": (1, 90, 1, 100, (0, 12, 12, 90), "strong"),
}


@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("case", list(CASES))
def test_cumsum_scores(case, dtype):
    B, T, H, K, cu, gates = CASES[case]
    q, k, g = _inputs(dtype, B, T, H, K, gates, seed=len(case) * 7 + len(dtype))
    bad = mismatches(run(q, k, g, cu), reference(q, k, g, cu), dtype)
    assert not bad, f"{case} {dtype}: {bad}"


LAYOUTS = [(False, "rows"), (True, "rows"), (False, "chunk")]     # (split, frame)


# diag "split" (a second kernel for the blocks that do not fit) exists for FRAME "chunk" only
COMBOS = [(sp, fr, d) for sp, fr in LAYOUTS for d in cs.DIAGS if d != "split" or fr == "chunk"]


@pytest.mark.parametrize("bk", [None, 16, 32])
@pytest.mark.parametrize("split,frame,diag", COMBOS)
def test_launch_switches(split, frame, diag, bk):
    """Every SPLIT / FRAME / DIAG / key-block choice on the varlen case with both kinds of
    gates (bk 16: bf16)."""
    B, T, H, K, cu, gates = CASES["varlen_mixed"]
    dtype = "fp32" if bk != 16 else "bf16"
    q, k, g = _inputs(dtype, B, T, H, K, gates, seed=11)
    got = run(q, k, g, cu, launch=Launch(bk, None, 4, 1), split=split, diag=diag, frame=frame)
    bad = mismatches(got, reference(q, k, g, cu), dtype)
    assert not bad, f"split={split} frame={frame} diag={diag} bk={bk}: {bad}"


@pytest.mark.parametrize("frame", ["rows", "chunk"])
def test_checker_catches_forced_fast_diagonal(monkeypatch, frame):
    """Strong gates through the factored diagonal dot (the fallback bypassed) fail the check:
    the test above would see a broken fallback."""
    B, T, H, K, cu, gates = CASES["mixed_k48"]
    q, k, g = _inputs("fp32", B, T, H, K, gates, seed=3)
    monkeypatch.setattr(cs, "_diag_fits", lambda loc: jnp.asarray(True))
    bad = mismatches(run(q, k, g, cu, diag="cond", frame=frame), reference(q, k, g, cu), "fp32")
    assert "A" in bad, bad


def test_checker_catches_missing_fix_kernel(monkeypatch):
    """diag "split" with the second kernel's exact blocks left out fails under strong gates:
    the scores kernel drops its factored blocks where they do not fit."""
    B, T, H, K, cu, gates = CASES["mixed_k48"]
    q, k, g = _inputs("fp32", B, T, H, K, gates, seed=3)
    monkeypatch.setattr(output_stage, "diag_fix_kernel", lambda refs, pb, bk, mats: None)
    bad = mismatches(run(q, k, g, cu, diag="split", frame="chunk"), reference(q, k, g, cu),
                     "fp32")
    assert "A" in bad, bad


@pytest.mark.parametrize("frame", ["rows", "chunk"])
def test_checker_catches_unmasked_varlen_rows(monkeypatch, frame):
    """Rows past a sequence's end read (the chunk's row count ignored) fail the check."""
    B, T, H, K, cu, gates = CASES["varlen_mixed"]
    q, k, g = _inputs("fp32", B, T, H, K, gates, seed=5)
    real = cs._chunk

    def unmasked(refs, pb):
        start, nv = real(refs, pb)
        return start, jnp.where(nv > 0, pb.bt, nv)

    monkeypatch.setattr(cs, "_chunk", unmasked)
    bad = mismatches(run(q, k, g, cu, frame=frame), reference(q, k, g, cu), "fp32")
    assert "A" in bad, bad


@pytest.mark.parametrize("kw", [dict(diag="split", frame="rows"), dict(diag="lop"),
                                dict(frame="rowz"), dict(split=True, frame="chunk")])
def test_bad_switch_names_argument(kw):
    """A switch combination the stage does not have raises (nothing silently swapped)."""
    q, k, g = _inputs("fp32", 1, 16, 1, 16, "weak", seed=0)
    with pytest.raises(ValueError, match="cumsum_scores: diag="):
        run(q, k, g, None, **kw)
