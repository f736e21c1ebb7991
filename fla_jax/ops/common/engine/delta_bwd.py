"""The key-side backward of the per-key-gated delta rule (Pallas, Triton lowering): the
gradients that reach k and the gate through the key scores Ak and kb (the mirror of the Ak /
kb part of fla_torch/ops/common/engine/delta_bwd.py; the output's Aqk, q exp(b) h and the
state update's kg, el go through the engine's output_stage.output_bwd, whose dk, dg this
kernel adds to).

One program per (chunk slot, head, K block). With b the in-chunk cumsum of the log-decay,
b_0 its first row, dAk (wy.wy_bwd, strictly lower) and dkb (the gradient of the relative
kb = k exp(b - b_0)):
    row side   r_i = sum_{j < i} dAk_ij k_j exp(b_i - b_j)
    col side   c_j = sum_{i > j} dAk_ij k_i exp(b_i - b_j)
    dk  = dk_o + r + c + dkb exp(b - b_0)
    db  = k (r - c) + dkb kb            (per key channel; no i == j pair, nothing O(1))
    dg_t = dg_o,t + sum_{s >= t} db_s   (in-chunk suffix sum)
kb depends on b only through k exp(b) (the factor exp(b_0) of the state side cancels:
w (diag(e0) h) is the product of the absolute terms), so no separate b_0 term arises.
Pairs of different sub-chunks go through the later sub-chunk's start (exponents <= 0) in fp32
dots; pairs inside a sub-chunk through output_stage._diag_grads (one fp32-accurate dot when
the decay across the sub-chunk stays under gates.SPAN, else per pair).
Shapes: k [B, T, H, K]; g, dkb, dk_o, dg_o [B, T, H, K] fp32; dAk [slots, H, BT, BT] fp32.
Returns dk in k's dtype, dg fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import gates as gt
from . import specs
from .delta_scores import chunk_b, rel_exp
from .launch import SUB, Launch, Problem, call, width
from .output_stage import _chunk, _diag_grads, _load_sub, _parallel_inputs, _sub_gates, \
    _sub_rows

F32 = jnp.float32
LAUNCH = Launch(64, None, 4, 1)


def _kernel(refs, pb, bk):
    r0 = pl.program_id(2) * bk
    prec = pb.precision
    start, nv = _chunk(refs, pb)
    rows = _sub_rows(pb, start, nv)
    nb = pb.bt // SUB
    ks = [x.astype(F32) for x in _load_sub(refs, "k", rows, pb.K, r0)]
    dkb = _load_sub(refs, "dkb", rows, pb.K, r0)
    dko = _load_sub(refs, "dk_o", rows, pb.K, r0)
    dgo = _load_sub(refs, "dg_o", rows, pb.K, r0)
    gs, _ = _sub_gates(refs, pb, start, nv, bk, pb.K, r0)
    bs = chunk_b(gs)
    b0 = gt.row(gs[0][0], 0)

    def dA(I, J):
        return refs["dAk"][pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)]

    rside, cside = [], []
    for I in range(nb):
        r, c = _diag_grads(refs, pb, rows[I][0], rows[I][1], ks[I], ks[I], gs[I], dA(I, I),
                           pb.K, r0)
        rside.append(r)
        cside.append(c)
    eloc = [jnp.exp(gs[I][0].value()) for I in range(nb)]
    for I in range(nb):
        for J in range(I):
            a = dA(I, J)
            to_I = jnp.exp(gt.span(gs[I][1], gs[J][1], gs[J][0]))     # exp(R_I - b_j)
            rside[I] = rside[I] + eloc[I] * ptr.matmul(a, ks[J] * to_I, (1, 0), prec)
            cside[J] = cside[J] + to_I * ptr.matmul(a, ks[I] * eloc[I], (0, 0), prec)
    dbs = []
    for I in range(nb):
        er = rel_exp(bs[I], b0)
        dk = dko[I] + rside[I] + cside[I] + dkb[I] * er
        ptr.store_rows(refs["dk"], rows[I][0], rows[I][1], pb.K, dk, r0)
        dbs.append(ks[I] * (rside[I] - cside[I]) + dkb[I] * ks[I] * er)
    later = jnp.zeros((bk,), F32)
    for I in reversed(range(nb)):
        db = dbs[I]
        suf = later[None, :] + (jnp.sum(db, axis=0)[None, :] - jnp.cumsum(db, axis=0) + db)
        later = later + jnp.sum(db, axis=0)
        ptr.store_rows(refs["dg"], rows[I][0], rows[I][1], pb.K, dgo[I] + suf, r0)


def delta_key_bwd(pb: Problem, k, g, dAk, dkb, dk_o, dg_o, cu, seq):
    """(dk [B, T, H, K] in k's dtype, dg [B, T, H, K] fp32): dk_o, dg_o (fp32, the output
    stage's) plus the gradients through Ak (dAk [slots, H, BT, BT] fp32) and the relative kb
    (dkb [B, T, H, K] fp32)."""
    bk = width(pb.Kp, LAUNCH.bk)
    par = dict(parallel=True)
    rows = specs.seq_rows(pb, bk, specs.same, **par)
    ins = [("k", k, rows), ("g", g, rows), ("dkb", dkb, rows), ("dk_o", dk_o, rows),
           ("dg_o", dg_o, rows),
           ("dAk", dAk, specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero))]
    ins += _parallel_inputs(pb, cu, seq)
    outs = [("dk", jax.ShapeDtypeStruct(k.shape, k.dtype), rows),
            ("dg", jax.ShapeDtypeStruct(g.shape, F32), rows)]
    r = call(lambda refs: _kernel(refs, pb, bk), (pb.n_slots, pb.H, pl.cdiv(pb.K, bk)), ins,
             outs, LAUNCH, "kda_delta_bwd")
    return r["dk"], r["dg"]
