"""Chunk-parallel preparation of the per-key-gated delta rule's inter-chunk state pass (Pallas,
Triton lowering): everything of delta_state.py's chunk loop that does not depend on the
carried state, formed once per (chunk slot, head) so the sequential loop only loads it (the
role of Triton's gates.chunk_cumsum for KDA).

With b the in-chunk cumsum of the log-decay (split, gates.py; rows past the sequence's end
read as 0), b_0 its first row and `last` its value at the chunk's end:
    forward:  kg = k exp(last - b)       [B, T, H, K] in k's dtype   (every exponent <= 0)
              e0 = exp(b_0), el = exp(last)   [slots, H, Kp] fp32  (padded columns: 1)
    backward: qd = q exp(b - b_0)        [B, T, H, K] in q's dtype   (every exponent <= 0)
              A_do = scale Aqk^T do      [B, T, H, V] fp32 (Aqk [slots, H, BT, BT] fp32 from
                                          delta_scores; ptr.split_matmul: bf16 hi + lo
                                          products for 16-bit do, pb.precision for fp32)
              dA = scale do vn^T (causal)   [slots, H, BT, BT] fp32 (the output stage's score
                                          gradient, so output_grads needs no dA kernel)
The same quantities, formed by the same operations, as the state loop formed them before.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import pallas_triton as ptr
from . import gates as gt
from . import specs
from .launch import Launch, Problem, call
from .output_stage import _chunk, _parallel_inputs

F32 = jnp.float32
LAUNCH = Launch(None, None, 4, 1)


def _cum(refs, pb, start, nv):
    """(cum [BT, Kp] Cum, first row [Kp] Cum, total [Kp] Cum) of this program's chunk."""
    g = gt.load_gate(refs["g"], gt.GATE_KEY, start, pb.bt, nv, pb.Kp, pb.K)
    cum, tot = gt.cumsum(g)
    return cum, gt.row(cum, 0), tot


def _fwd_kernel(refs, pb):
    start, nv = _chunk(refs, pb)
    cum, first, tot = _cum(refs, pb, start, nv)
    k = ptr.load_rows(refs["k"], start, pb.bt, nv, pb.K)
    kg = (k * jnp.exp(gt.gap(gt.bcast(tot), cum))).astype(k.dtype)
    ptr.store_rows(refs["kg"], start, nv, pb.K, kg)
    refs["e0"][...] = jnp.exp(first.value())
    refs["el"][...] = jnp.exp(tot.value())


def _bwd_kernel(refs, pb):
    start, nv = _chunk(refs, pb)
    cum, first, _ = _cum(refs, pb, start, nv)
    q = ptr.load_rows(refs["q"], start, pb.bt, nv, pb.K)
    qd = (q * jnp.exp(gt.gap(cum, gt.bcast(first)))).astype(q.dtype)
    ptr.store_rows(refs["qd"], start, nv, pb.K, qd)
    do = ptr.load_rows(refs["do"], start, pb.bt, nv, pb.V)
    A = refs["Aqk"][...]
    ado = pb.scale * ptr.split_matmul(A, do, (0, 0), pb.precision)
    ptr.store_rows(refs["Ado"], start, nv, pb.V, ado)
    vn = ptr.load_rows(refs["vn"], start, pb.bt, nv, pb.V)
    ii, jj = jnp.arange(pb.bt)[:, None], jnp.arange(pb.bt)[None, :]
    refs["dA"][...] = jnp.where(ii >= jj, pb.scale * ptr.matmul(do, vn, (1, 1), pb.precision),
                                0.0)


def _rows(pb, width):
    return specs.seq_rows(pb, width, specs.zero, parallel=True)


def delta_prep_fwd(pb: Problem, k, g, cu, seq):
    """k [B, T, H, K], g [B, T, H, K] fp32, cu / seq (varlen: cu_seqlens int32 [N+1] and
    varlen.slot_sequences; else None). Returns (kg [B, T, H, K] in k's dtype,
    e0 [slots, H, Kp] fp32, el [slots, H, Kp] fp32)."""
    ins = [("k", k, _rows(pb, pb.Kp)), ("g", g, _rows(pb, pb.Kp))] + \
        _parallel_inputs(pb, cu, seq)
    vec = jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp), F32)
    outs = [("kg", jax.ShapeDtypeStruct(k.shape, k.dtype), _rows(pb, pb.Kp)),
            ("e0", vec, specs.slot_vec(pb.Kp)), ("el", vec, specs.slot_vec(pb.Kp))]
    r = call(lambda refs: _fwd_kernel(refs, pb), (pb.n_slots, pb.H, 1), ins, outs, LAUNCH,
             "kda_state_prep_fwd")
    return r["kg"], r["e0"], r["el"]


def delta_prep_bwd(pb: Problem, q, g, Aqk, do, vn, cu, seq):
    """q [B, T, H, K], g [B, T, H, K] fp32, Aqk [slots, H, BT, BT] fp32, do, vn [B, T, H, V]
    (one dtype), cu / seq as delta_prep_fwd. Returns (qd [B, T, H, K] in q's dtype, A_do
    [B, T, H, V] fp32, dA [slots, H, BT, BT] fp32: the output's score gradient
    scale do vn^T, zero above the diagonal, for output_grads)."""
    sq = specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)
    ins = [("q", q, _rows(pb, pb.Kp)), ("g", g, _rows(pb, pb.Kp)), ("Aqk", Aqk, sq),
           ("do", do, _rows(pb, pb.Vp)), ("vn", vn, _rows(pb, pb.Vp))]
    ins += _parallel_inputs(pb, cu, seq)
    outs = [("qd", jax.ShapeDtypeStruct(q.shape, q.dtype), _rows(pb, pb.Kp)),
            ("Ado", jax.ShapeDtypeStruct(do.shape, F32), _rows(pb, pb.Vp)),
            ("dA", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.bt, pb.bt), F32), sq)]
    r = call(lambda refs: _bwd_kernel(refs, pb), (pb.n_slots, pb.H, 1), ins, outs, LAUNCH,
             "kda_state_prep_bwd")
    return r["qd"], r["Ado"], r["dA"]
