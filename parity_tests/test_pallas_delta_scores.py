"""The Pallas KDA score stage `delta_scores` (Aqk, Ak, kb, qg) in both frames against a float64 numpy
reference, on CPU, interpreted (outputs start NaN-filled, so an unwritten element fails).

Per element, |got - ref| <= rtol * scale + atol, scale the float64 sum of the absolute terms
(Aqk: sum_c |q_ic k_jc| exp(b_ic - b_jc), Ak the same with k_ic; kb: |ref|), so tiny decayed
entries are held to the same relative accuracy as O(1) ones (fp32), up to the 16-bit rounding
floor. Cases: weak gates and gates up to just under gates.SPAN across a sub-chunk (the factored
diagonal dots of FRAME "chunk"), channels at -20 per token (its per-pair loop), key blocks of
both decisions in one call (K = 144: weak, strong, weak, padding), varlen with an empty
sequence and sequences crossing chunks, K = 48 / 100 / 144 (not powers of two, K > 64: more
than one key block), T not a multiple of the chunk. Unused varlen slots must hold Aqk = Ak = 0.
FRAME "chunk" runs with both DIAG variants: "split" (the factored blocks kept where the key
block's decay fits, the exact blocks of the rest added by a second kernel) and "cond".
`test_checker_catches_forced_fast_diagonal`: the factored
diagonal forced under strong gates makes the same check fail; likewise the second kernel's
exact blocks left out.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.common import pallas_triton as ptr
from fla_jax.ops.common.engine import delta_scores as ds
from fla_jax.ops.common.engine import output_stage
from fla_jax.ops.common.engine import varlen as vl

from .cases import interpreted_dtypes
from .score_stage import BT, DT, TOL, bounded_mismatch, inputs, run_stage


def _gates(kind, rng, shape):
    K = shape[-1]
    c = np.arange(K)[None, None, None, :]
    if kind == "weak":
        return -rng.uniform(0.0, 0.01, shape)
    if kind == "edge":                # up to 19.2 nats across a sub-chunk: factors near e^SPAN
        return -rng.uniform(0.0, 1.2, shape)
    g = -rng.uniform(0.0, 0.5, shape)
    strong = c % 3 == 0                               # "strong": every key block
    if kind == "mixed":                               # key blocks of 64: 1 strong, 0 / 2 weak
        strong &= (c // 64) % 2 == 1
    return np.where(strong, -20.0, g)


def _inputs(dtype, B, T, H, K, gates, seed):
    return inputs(dtype, B, T, H, K, functools.partial(_gates, gates), seed)


def reference(q, k, g, cu):
    """float64 (Aqk, Ak, their scales, kb, qg, (kg, e0, el)) over the slots of varlen.py; unused slots: zeros
    (kb: NaN past every sequence, nothing is defined there)."""
    q, k, g = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, g))
    B, T, H, K = q.shape
    if cu is None:
        seqs = [(n, n, 0, T) for n in range(B)]
    else:
        seqs = [(n, 0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    S = vl.n_slots(T, BT, len(seqs), cu is not None)
    out = {x: np.zeros((S, H, BT, BT)) for x in ("Aqk", "Ak", "sAqk", "sAk")}
    kb, qg, kg = (np.full(q.shape, np.nan) for _ in range(3))
    Kp = ptr.padded(K)
    e0, el = np.full((S, H, Kp), np.nan), np.full((S, H, Kp), np.nan)
    for n, row, bos, eos in seqs:
        first = bos // BT + n if cu is not None else n * vl.n_chunks(T, BT)
        for c in range(-(-(eos - bos) // BT)):
            s, e = bos + c * BT, min(bos + (c + 1) * BT, eos)
            slot, L = first + c, e - s
            b = np.cumsum(g[row, s:e], axis=0)                          # [L, H, K]
            kb[row, s:e] = k[row, s:e] * np.exp(b - b[:1])
            qg[row, s:e] = q[row, s:e] * np.exp(b)
            kg[row, s:e] = k[row, s:e] * np.exp(b[-1:] - b)
            e0[slot, :, :K], el[slot, :, :K] = np.exp(b[0]), np.exp(b[-1])
            for name, x, diag in (("Aqk", q, 0), ("Ak", k, -1)):
                mask = np.tril(np.ones((L, L), bool), diag)[:, :, None, None]
                gapx = np.where(mask, b[:, None] - b[None, :], -np.inf)  # [i, j, H, K]
                terms = x[row, s:e][:, None] * k[row, s:e][None, :] * np.exp(gapx)
                out[name][slot, :, :L, :L] = np.transpose(terms.sum(-1), (2, 0, 1))
                out["s" + name][slot, :, :L, :L] = np.transpose(np.abs(terms).sum(-1), (2, 0, 1))
    return out, kb, qg, (kg, e0, el)


def run(q, k, g, cu, **kw):
    return run_stage(ds.delta_scores, q, k, g, cu, **kw)


def mismatches(got, ref, dtype):
    """{output: (bad element count, worst |err| / (rtol scale + atol))} of the outputs that
    fail their bound (empty: all pass)."""
    Aqk, Ak, kb, qg, kg, e0, el = got
    r, rkb, rqg, (rkg, re0, rel) = ref
    out = {}

    def check(name, x, want, s, tol):
        # NaN in want: rows no sequence covers (kb, qg, kg are not written there), unused slots
        bad = bounded_mismatch(x, want, s, tol, skip_undefined=True)
        if bad:
            out[name] = bad

    assert Aqk.dtype == Ak.dtype == jnp.float32 and kb.dtype == DT[dtype], (Aqk.dtype, kb.dtype)
    assert Aqk.shape == Ak.shape == r["Aqk"].shape and kb.shape == rkb.shape
    check("Aqk", Aqk, r["Aqk"], r["sAqk"], TOL[dtype]["A"])
    check("Ak", Ak, r["Ak"], r["sAk"], TOL[dtype]["A"])
    check("kb", kb, rkb, np.abs(rkb), TOL[dtype]["x"])
    assert qg.dtype == DT[dtype] and qg.shape == rqg.shape
    check("qg", qg, rqg, np.abs(rqg), TOL[dtype]["x"])
    assert kg.dtype == DT[dtype] and e0.dtype == el.dtype == jnp.float32
    check("kg", kg, rkg, np.abs(rkg), TOL[dtype]["x"])
    # exp(b_0), exp(last) of the used slots' key columns (fp32 whatever the dtype)
    check("e0", e0, re0, np.abs(re0), TOL["fp32"]["x"])
    check("el", el, rel, np.abs(rel), TOL["fp32"]["x"])
    return out


# (B, T, H, K, cu_seqlens, gates)
CASES = {
    "weak_k48": (2, 100, 2, 48, None, "weak"),
    "edge_k64": (1, 64, 2, 64, None, "edge"),
    "strong_k100": (1, 130, 1, 100, None, "strong"),
    "mixed_k144": (1, 80, 1, 144, None, "mixed"),
    "varlen_mixed_k100": (1, 160, 1, 100, (0, 0, 5, 70, 150, 160), "mixed"),
    "varlen_strong_k48": (1, 90, 1, 48, (0, 12, 12, 90), "strong"),
}


# (frame, diag): FRAME "rows", and FRAME "chunk" with its diagonal blocks in the second kernel
# (exact per pair) or in the scores kernel (factored dot where the decay fits, else per pair)
VARIANTS = [("rows", None)] + [("chunk", d) for d in ds.DIAGS]


# every variant x case in fp32 and, interpreted on CPU, one of bf16 / fp16 (alternating:
# cases.interpreted_dtypes); on a GPU run in all three
SCORE_ROWS = [pytest.param(f, d, c, dt, id=f"{f}-{d}-{c}-{dt}")
              for i, (f, d) in enumerate(VARIANTS) for j, c in enumerate(CASES)
              for dt in interpreted_dtypes(i + j, tuple(DT))]


@pytest.mark.parametrize("frame,diag,case,dtype", SCORE_ROWS)
def test_delta_scores(frame, diag, case, dtype):
    B, T, H, K, cu, gates = CASES[case]
    q, k, g = _inputs(dtype, B, T, H, K, gates, seed=len(case) * 7 + len(dtype))
    bad = mismatches(run(q, k, g, cu, frame=frame, diag=diag), reference(q, k, g, cu), dtype)
    assert not bad, f"{frame} {diag} {case} {dtype}: {bad}"


@pytest.mark.parametrize("bk", [16, 32])
def test_chunk_key_blocks(bk):
    """Narrower key blocks of FRAME "chunk" (more blocks, each its own diagonal decision)."""
    B, T, H, K, cu, gates = CASES["varlen_mixed_k100"]
    q, k, g = _inputs("fp32", B, T, H, K, gates, seed=11)
    bad = mismatches(run(q, k, g, cu, frame="chunk", bk=bk), reference(q, k, g, cu), "fp32")
    assert not bad, f"bk={bk}: {bad}"


def test_checker_catches_forced_fast_diagonal(monkeypatch):
    """Strong gates through the factored diagonal dots (the per-pair loop bypassed) fail the
    check: the tests above would see a broken fallback."""
    B, T, H, K, cu, gates = CASES["strong_k100"]
    q, k, g = _inputs("fp32", B, T, H, K, gates, seed=3)
    monkeypatch.setattr(ds, "_diag_fits", lambda loc: jnp.asarray(True))
    bad = mismatches(run(q, k, g, cu, frame="chunk", diag="cond"), reference(q, k, g, cu),
                     "fp32")
    assert "Aqk" in bad and "Ak" in bad, bad


def test_checker_catches_missing_fix_kernel(monkeypatch):
    """DIAG "split" with the second kernel's exact blocks left out (its stores dropped) fails
    under strong gates: the scores kernel drops its factored blocks where they do not fit."""
    B, T, H, K, cu, gates = CASES["strong_k100"]
    q, k, g = _inputs("fp32", B, T, H, K, gates, seed=5)
    monkeypatch.setattr(output_stage, "diag_fix_kernel", lambda refs, pb, bk, mats: None)
    bad = mismatches(run(q, k, g, cu, frame="chunk", diag="split"), reference(q, k, g, cu),
                     "fp32")
    assert "Aqk" in bad and "Ak" in bad, bad


@pytest.mark.parametrize("kw,name", [(dict(frame="rowz"), "frame="), (dict(bk=48), "bk="),
                                     (dict(diag="loop"), "diag=")])
def test_bad_switch_names_argument(kw, name):
    q, k, g = _inputs("fp32", 1, 16, 1, 16, "weak", seed=0)
    with pytest.raises(ValueError, match=name):
        run(q, k, g, None, **kw)
