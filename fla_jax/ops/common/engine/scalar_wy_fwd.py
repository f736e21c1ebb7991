"""Pallas kernel: per-chunk WY (UT-transform) preparation for the (gated) delta rule.

For one chunk of BT tokens (rows i, j) of one value head, with gc = chunk-local cumsum of g
(fp32; zero when ungated) and Gamma = exp(gc):
    A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j)        for j < i   (strictly lower)
    Tm      = (I + A)^{-1}                                (unit lower triangular)
    W       = Tm (beta Gamma K)     [BT, K]
    U       = Tm (beta V)           [BT, V]
so that the chunk's innovations are v_new = U - W S0 (S0 = state at the chunk start).
W is stored as exp(-gc_0) W (gc_0 = g of the chunk's first token): its largest row keeps its
scale, where exp(gc) alone flushes fp16 W to zero under strong gates (dh0 lost all accuracy);
every user of W multiplies its product with W by exp(gc_0) in fp32.
Tm is built from 16x16 diagonal blocks (forward substitution in registers, exact fp32 FMAs)
joined by block products: Tm_ab = -Tm_aa sum_{b <= c < a} A_ac Tm_cb (fp32-accurate dots).
For training, Tm itself (in k's dtype, the precision the W/U products use) is stored per chunk
slot, so the backward reads it instead of inverting again.

One program per chunk slot of engine/varlen.py (`slot_table`: the (start, end) tokens of each
slot), so one grid covers fixed-size and packed varlen batches alike (unused slots are empty).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..dispatch import pallas_interpret
from ..pallas_delta_layout import dot_precision, kdot, l2norm_fwd, triton_params

F32 = jnp.float32
SUB = 16


def masked_rows(ref, start, end, n_rows, head, cols=None, other=0.0):
    """Load rows start .. start+n_rows of ref[:, head, cols] with rows >= end set to `other`."""
    from jax.experimental.pallas import triton as plt
    rows = start + lax.broadcasted_iota(jnp.int32, (n_rows,), 0)
    mask = rows < end
    if ref.ndim == 2:
        return plt.load(ref.at[pl.ds(start, n_rows), head], mask=mask, other=other)
    cols = slice(None) if cols is None else cols
    return plt.load(ref.at[pl.ds(start, n_rows), head, cols], mask=mask[:, None], other=other)


def first_entry(x):
    """x[0] of a 1-D in-kernel array as a masked sum (the Triton lowering has no `slice`)."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, 0) == 0, x, 0.0))


def store_rows(ref, val, start, end, head, cols=None):
    from jax.experimental.pallas import triton as plt
    n_rows = val.shape[0]
    rows = start + lax.broadcasted_iota(jnp.int32, (n_rows,), 0)
    mask = rows < end
    if ref.ndim == 2:
        plt.store(ref.at[pl.ds(start, n_rows), head], val.astype(ref.dtype), mask=mask)
        return
    cols = slice(None) if cols is None else cols
    plt.store(ref.at[pl.ds(start, n_rows), head, cols], val.astype(ref.dtype),
              mask=mask[:, None])


def _inv_unit_lower_blocks(As):
    """[(I + A)^{-1} for A in As]: strictly lower [SUB, SUB] fp32 blocks, by forward
    substitution (exact fp32 FMAs). The row loop is unrolled and runs the independent blocks
    side by side, so their dependency chains overlap instead of running one after another."""
    r = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    c = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    col = lax.broadcasted_iota(jnp.int32, (SUB,), 0)
    eye = (r == c).astype(F32)
    Ts = [eye for _ in As]
    for i in range(1, SUB):
        for a, A in enumerate(As):
            a_i = jnp.sum(jnp.where(r == i, A, 0.0), axis=0)                 # row i of A
            new = jnp.where(col == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * Ts[a], axis=0)
            Ts[a] = jnp.where(r == i, new[None, :], Ts[a])
    return Ts


def _prep_kernel(tab_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, *tm_refs, G, BT, has_g,
                 l2norm, prec):
    s, hv = pl.program_id(0), pl.program_id(1)
    h = hv // G
    start, end = tab_ref[s, 0], tab_ref[s, 1]
    NB = BT // SUB
    dt = k_ref.dtype

    @pl.when(end > start)
    def _():
        ks, xs_w, xs_u, gcs, betas = [], [], [], [], []
        carry = jnp.zeros((), F32)
        for b in range(NB):
            st = start + b * SUB
            k = masked_rows(k_ref, st, end, SUB, h)
            k = l2norm_fwd(k).astype(dt) if l2norm else k
            beta = masked_rows(b_ref, st, end, SUB, hv)
            v = masked_rows(v_ref, st, end, SUB, hv)
            if has_g:
                gb = masked_rows(g_ref, st, end, SUB, hv)
                gc = jnp.cumsum(gb) + carry
                carry = carry + jnp.sum(gb)
            else:
                gc = jnp.zeros((SUB,), F32)
            ks.append(k)
            gcs.append(gc)
            betas.append(beta)
            if b == 0:   # W relative to the chunk's first token (see the module docstring)
                g0 = first_entry(gc)
            xs_w.append((k.astype(F32) * (beta * jnp.exp(gc - g0))[:, None]).astype(dt))
            xs_u.append((v.astype(F32) * beta[:, None]).astype(dt))
        r = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
        c = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
        A = {}
        for a in range(NB):
            for b in range(a + 1):
                kk = kdot(ks[a], ks[b].T, prec)
                keep = (r > c) if a == b else jnp.ones((SUB, SUB), jnp.bool_)
                diff = jnp.where(keep, gcs[a][:, None] - gcs[b][None, :], 0.0)
                A[a, b] = jnp.where(keep, betas[a][:, None] * kk * jnp.exp(diff), 0.0)
        Tm = dict(((a, a), t) for a, t in
                  enumerate(_inv_unit_lower_blocks([A[a, a] for a in range(NB)])))
        for a in range(NB):
            for b in range(a - 1, -1, -1):
                acc = jnp.zeros((SUB, SUB), F32)
                for cc in range(b, a):
                    acc = acc + kdot(A[a, cc], Tm[cc, b], prec)
                Tm[a, b] = -kdot(Tm[a, a], acc, prec)
        for a in range(NB):
            w = jnp.zeros((SUB, k_ref.shape[-1]), F32)
            u = jnp.zeros((SUB, v_ref.shape[-1]), F32)
            for b in range(a + 1):
                t = Tm[a, b].astype(dt)
                w = w + kdot(t, xs_w[b], prec)
                u = u + kdot(t, xs_u[b], prec)
            store_rows(w_ref, w, start + a * SUB, end, hv)
            store_rows(u_ref, u, start + a * SUB, end, hv)
        if tm_refs:   # every block written (zeros above the diagonal): the tile is read whole
            (tm_ref,) = tm_refs
            zero = jnp.zeros((SUB, SUB), dt)
            for a in range(NB):
                for b in range(NB):
                    t = Tm[a, b].astype(dt) if b <= a else zero
                    tm_ref[s, hv, pl.ds(a * SUB, SUB), pl.ds(b * SUB, SUB)] = t


def wy_prep(k, v, g, beta, table, *, H_ratio: int, BT: int, l2norm: bool, out_rows: int,
            num_warps: int = 4, num_stages: int = 1, want_tm: bool = False):
    """k: [R, H, K]; v: [R, HV, V] (one dtype); g (fp32 or None), beta fp32: [R, HV];
    table: int32 [NC, 2]. Returns W [out_rows, HV, K] and U [out_rows, HV, V] in k's dtype
    (rows not covered by a chunk are left unwritten), plus Tm [NC, HV, BT, BT] in k's dtype
    when want_tm (slots of empty chunks left unwritten)."""
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    interpret = pallas_interpret()
    kernel = functools.partial(_prep_kernel, G=H_ratio, BT=BT, has_g=g is not None,
                               l2norm=l2norm, prec=dot_precision(interpret))
    ins = [table, k, v, g if g is not None else beta, beta]
    out_shape = [jax.ShapeDtypeStruct((out_rows, HV, K), k.dtype),
                 jax.ShapeDtypeStruct((out_rows, HV, V), k.dtype)]
    if want_tm:
        out_shape.append(jax.ShapeDtypeStruct((table.shape[0], HV, BT, BT), k.dtype))
    params = None if interpret else triton_params(num_warps, num_stages)
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(table.shape[0], HV),
                                interpret=interpret, name="delta_wy_prep",
                                compiler_params=params)(*ins))
