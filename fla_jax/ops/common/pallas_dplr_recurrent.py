"""Token-by-token diagonal-plus-low-rank recurrences (KDA, RWKV-7) as Pallas kernels (Triton
lowering; interpreted on CPU), forward and backward, for any `Family` of per-token steps.

Per sequence n and value head hv (q/k head h = hv // G), one program per block of BV value
columns keeps its state S[:, block] (fp32 [Kp, BV]) in registers and walks the tokens; every
step is column-separable (its rank-one terms read S only through k^T S / a^T S per column),
so value blocks never talk to each other.

Forward: o_t from S_t; training runs also store a checkpoint of the state before every
CHUNK-th token of each sequence (fp32, varlen slot `bos // CHUNK + n + c`, so
`cdiv(B*T, CHUNK) + N` slots cover every sequence without a host sync).
Backward (the transition is not invertible): chunks in reverse; each restarts from its
checkpoint, walks its tokens forward storing S_{t-1} in a per-program workspace
([CHUNK, Kp, BV] fp32 in global memory), then walks them in reverse with dS (the gradient
w.r.t. S_t), so every gradient, the decay's included, is formed from the exact S_{t-1} and
dS of its own token: nothing is accumulated along the sequence and cancels. At most
MAX_BWD_PROGRAMS backward programs stride over the (sequence, head, value block) items, so
the workspace does not grow with the number of sequences.
Gradients per head-dim row are partials over value blocks (and, for grouped heads, per value
head); the wrapper sums them and applies the l2norm backward.
Layout: [B, T, H, D] viewed as [B*T, H, D]; head sizes zero-padded to powers of two.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .dispatch import pallas_interpret
from .pallas_delta_layout import (group_sum, l2norm_bwd, l2norm_fwd, next_pow2, pad_last,
                                  sequence_bounds, triton_params)

F32 = jnp.float32
CHUNK = 64          # tokens between two state checkpoints (and workspace depth)
MAX_BWD_PROGRAMS = 512   # backward programs (grid-stride over items), so the workspace
                         # (<= 1 MiB each: Kp * BV <= 4096) stays <= 512 MiB for any N

QK, KROW, SCALAR = "qk", "krow", "scalar"   # input roles besides v


@dataclass(frozen=True)
class Family:
    """One recurrence. `inputs`: (name, role) in call order, v excluded: QK = [B, T, H, K]
    activation (l2-normalised when asked), KROW = [B, T, HV, K] fp32, SCALAR = [B, T, HV]
    fp32. `step(S, x, scale) -> (S_t, o_t)` with S = S_{t-1} [Kp, BV] and x the token's rows
    (fp32; x['v'] the value block). `step_bwd(P, dS, x, do, scale) -> (dS_{t-1}, grads, dv)`
    with P = S_{t-1}, dS the gradient w.r.t. S_t from later tokens (o_t's part not yet
    added), grads {input name: [Kp] row partial or scalar partial}."""
    name: str
    inputs: tuple
    step: Callable
    step_bwd: Callable


def _block_v(Kp: int, Vp: int) -> int:
    return min(Vp, 32 if Kp <= 128 else 16)


def _barrier(interpret: bool):
    """Make this program's global stores visible to all its threads before re-reading."""
    if not interpret:
        from jax.experimental.pallas import triton as plt
        plt.debug_barrier()


def _load(R, fam, t, h, hv, vs, l2norm):
    x = {}
    for name, role in fam.inputs:
        if role == QK:
            row = R[name][t, h, :].astype(F32)
            x[name] = l2norm_fwd(row) if l2norm else row
        elif role == KROW:
            x[name] = R[name][t, hv, :]
        else:
            x[name] = R[name][t, hv]
    x["v"] = R["v"][t, hv, vs].astype(F32)
    return x


def _ids(R, G, BV):
    n, hv, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    return n, hv, iv, hv // G, pl.ds(iv * BV, BV), R["cu"][n], R["cu"][n + 1]


def _initial(R, n, hv, vs, Kp, BV, name):
    return R[name][n, hv, :, vs] if name in R else jnp.zeros((Kp, BV), F32)


def _fwd_kernel(*refs, fam, names, scale, G, Kp, BV, l2norm, save_ckpt):
    R = dict(zip(names, refs))
    n, hv, iv, h, vs, bos, eos = _ids(R, G, BV)

    def token(t, S):
        S, o = fam.step(S, _load(R, fam, t, h, hv, vs, l2norm), scale)
        R["o"][t, hv, vs] = o.astype(R["o"].dtype)
        return S

    S = _initial(R, n, hv, vs, Kp, BV, "h0")
    if save_ckpt:
        slot0 = bos // CHUNK + n

        def chunk(c, S):
            R["ckpt"][slot0 + c, hv, :, vs] = S
            t0 = bos + c * CHUNK
            return lax.fori_loop(t0, jnp.minimum(t0 + CHUNK, eos), token, S)

        S = lax.fori_loop(0, (eos - bos + CHUNK - 1) // CHUNK, chunk, S)
    else:
        S = lax.fori_loop(bos, eos, token, S)
    R["ht"][n, hv, :, vs] = S


def _bwd_kernel(*refs, fam, names, scale, G, Kp, BV, NV, HV, NI, l2norm, interpret):
    R = dict(zip(names, refs))
    p, P = pl.program_id(0), pl.num_programs(0)

    def item(j, carry):
        idx = p + j * P                       # item = (sequence n, value head hv, block iv)
        iv, n, hv = idx % NV, idx // (NV * HV), (idx // NV) % HV
        _bwd_item(R, fam, p, n, hv, iv, scale=scale, G=G, Kp=Kp, BV=BV, l2norm=l2norm,
                  interpret=interpret)
        return carry

    lax.fori_loop(0, (NI - p + P - 1) // P, item, 0)


def _bwd_item(R, fam, p, n, hv, iv, *, scale, G, Kp, BV, l2norm, interpret):
    """One sequence, value head and value block; workspace row p is this program's."""
    h, vs = hv // G, pl.ds(iv * BV, BV)
    bos, eos = R["cu"][n], R["cu"][n + 1]
    slot0 = bos // CHUNK + n
    nc = (eos - bos + CHUNK - 1) // CHUNK

    def chunk(ci, dS):
        c = nc - 1 - ci
        t0 = bos + c * CHUNK
        t1 = jnp.minimum(t0 + CHUNK, eos)

        def replay(t, S):
            R["ws"][p, t - t0] = S
            S, _ = fam.step(S, _load(R, fam, t, h, hv, vs, l2norm), scale)
            return S

        lax.fori_loop(t0, t1, replay, R["ckpt"][slot0 + c, hv, :, vs])
        _barrier(interpret)

        def reverse(i, dS):
            t = t1 - 1 - i
            x = _load(R, fam, t, h, hv, vs, l2norm)
            do = R["do"][t, hv, vs].astype(F32)
            dS, grads, dv = fam.step_bwd(R["ws"][p, t - t0], dS, x, do, scale)
            for name, g in grads.items():
                if g.ndim == 1:
                    R["d" + name][iv, t, hv, :] = g
                else:
                    R["d" + name][iv, t, hv] = g
            R["dv"][t, hv, vs] = dv
            return dS

        dS = lax.fori_loop(0, t1 - t0, reverse, dS)
        _barrier(interpret)
        return dS

    dS = lax.fori_loop(0, nc, chunk, _initial(R, n, hv, vs, Kp, BV, "dht"))
    if "dh0" in R:
        R["dh0"][n, hv, :, vs] = dS


def _dims(xs, fam, v):
    BT, H, Kp = xs[fam.inputs[0][0]].shape
    return BT, H, Kp, v.shape[1], v.shape[2]


def _forward(fam, xs, v, h0, cu, *, scale, l2norm, save_ckpt):
    """xs: {name: flattened padded input}; v [BT, HV, Vp]. Returns o, ht, ckpt (or None)."""
    BT, H, Kp, HV, Vp = _dims(xs, fam, v)
    N = cu.shape[0] - 1
    BV = _block_v(Kp, Vp)
    interpret = pallas_interpret()
    ins = {"cu": cu, **xs, "v": v}
    if h0 is not None:
        ins["h0"] = h0
    outs = {"o": jax.ShapeDtypeStruct((BT, HV, Vp), xs[fam.inputs[0][0]].dtype),
            "ht": jax.ShapeDtypeStruct((N, HV, Kp, Vp), F32)}
    if save_ckpt:
        outs["ckpt"] = jax.ShapeDtypeStruct((pl.cdiv(BT, CHUNK) + N, HV, Kp, Vp), F32)
    kernel = functools.partial(_fwd_kernel, fam=fam, names=tuple(ins) + tuple(outs),
                               scale=scale, G=HV // H, Kp=Kp, BV=BV, l2norm=l2norm,
                               save_ckpt=save_ckpt)
    r = pl.pallas_call(kernel, out_shape=list(outs.values()), grid=(N, HV, Vp // BV),
                       interpret=interpret, name=f"fused_recurrent_{fam.name}_fwd",
                       compiler_params=None if interpret else triton_params(4))(*ins.values())
    return r[0], r[1], (r[2] if save_ckpt else None)


def _backward(fam, xs, v, h0, cu, ckpt, do, dht, *, scale, l2norm):
    """fp32 gradients: {name: per value head, summed over value blocks}, dv, dh0 (or None)."""
    BT, H, Kp, HV, Vp = _dims(xs, fam, v)
    N = cu.shape[0] - 1
    BV = _block_v(Kp, Vp)
    NV = Vp // BV
    interpret = pallas_interpret()
    ins = {"cu": cu, **xs, "v": v, "ckpt": ckpt, "do": do}
    if dht is not None:
        ins["dht"] = dht
    outs = {}
    for name, role in fam.inputs:
        shape = (NV, BT, HV) if role == SCALAR else (NV, BT, HV, Kp)
        outs["d" + name] = jax.ShapeDtypeStruct(shape, F32)
    outs["dv"] = jax.ShapeDtypeStruct((BT, HV, Vp), F32)
    if h0 is not None:
        outs["dh0"] = jax.ShapeDtypeStruct(h0.shape, F32)
    NI = N * HV * NV
    P = min(NI, MAX_BWD_PROGRAMS)
    outs["ws"] = jax.ShapeDtypeStruct((P, CHUNK, Kp, BV), F32)
    kernel = functools.partial(_bwd_kernel, fam=fam, names=tuple(ins) + tuple(outs),
                               scale=scale, G=HV // H, Kp=Kp, BV=BV, NV=NV, HV=HV, NI=NI,
                               l2norm=l2norm, interpret=interpret)
    r = pl.pallas_call(kernel, out_shape=list(outs.values()), grid=(P,),
                       interpret=interpret, name=f"fused_recurrent_{fam.name}_bwd",
                       compiler_params=None if interpret else triton_params(4))(*ins.values())
    r = dict(zip(outs, r))
    grads = {name: r["d" + name].sum(0) for name, _ in fam.inputs}
    return grads, r["dv"], r.get("dh0")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6, 7))
def _recurrent(fam, xs, v, h0, cu, scale, l2norm, want_ht):
    o, ht, _ = _forward(fam, xs, v, h0, cu, scale=scale, l2norm=l2norm, save_ckpt=False)
    return o, ht


def _recurrent_fwd(fam, xs, v, h0, cu, scale, l2norm, want_ht):
    o, ht, ckpt = _forward(fam, xs, v, h0, cu, scale=scale, l2norm=l2norm, save_ckpt=True)
    return (o, ht), (xs, v, h0, cu, ckpt)


def _recurrent_bwd(fam, scale, l2norm, want_ht, res, cts):
    xs, v, h0, cu, ckpt = res
    do, dht = cts
    grads, dv, dh0 = _backward(fam, xs, v, h0, cu, ckpt, do.astype(v.dtype),
                               dht.astype(F32) if want_ht else None, scale=scale,
                               l2norm=l2norm)
    H = xs[fam.inputs[0][0]].shape[1]
    dxs = {}
    for name, role in fam.inputs:
        g = grads[name]
        if role == QK:
            g = group_sum(g, H)
            if l2norm:
                g = l2norm_bwd(xs[name], g)
        dxs[name] = g.astype(xs[name].dtype)
    return (dxs, dv.astype(v.dtype), None if h0 is None else dh0.astype(h0.dtype), None)


_recurrent.defvjp(_recurrent_fwd, _recurrent_bwd)


def run_recurrent(fam: Family, tensors: dict, v, *, scale, initial_state, output_final_state,
                  cu_seqlens, l2norm=False):
    """Flatten and pad the inputs, run the kernels, unpad.

    tensors: {name: array} for fam.inputs (QK [B, T, H, K] in the activation dtype, KROW
    [B, T, HV, K] fp32, SCALAR [B, T, HV] fp32); v [B, T, HV, V] (v's dtype = the
    activations'); initial_state None or [N, HV, K, V] fp32; cu_seqlens None or int [N+1]
    (B == 1; may be traced). Returns (o [B, T, HV, V] in the activations' dtype,
    final_state [N, HV, K, V] fp32 or None). Differentiable w.r.t. every tensor and
    initial_state (custom_vjp)."""
    B, T, HV, V = v.shape
    K = tensors[fam.inputs[0][0]].shape[-1]
    Kp, Vp = next_pow2(K), next_pow2(V)
    cu = sequence_bounds(B, T, cu_seqlens)
    xs = {}
    for name, role in fam.inputs:
        x = tensors[name]
        if role == SCALAR:
            xs[name] = x.reshape(B * T, x.shape[2])
        else:
            xs[name] = pad_last(x.reshape(B * T, x.shape[2], K), Kp)
    vf = pad_last(v.reshape(B * T, HV, V), Vp)
    h0 = initial_state
    if h0 is not None and (Kp != K or Vp != V):
        h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
    o, ht = _recurrent(fam, xs, vf, h0, cu, float(scale), bool(l2norm),
                       bool(output_final_state))
    o = o[..., :V].reshape(B, T, HV, V)
    return o, (ht[:, :, :K, :V] if output_final_state else None)
