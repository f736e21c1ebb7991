"""Token-by-token RWKV-7 as Pallas kernels (Triton lowering; interpreted on CPU), forward and
backward, on the DPLR recurrent driver (fla_jax/ops/common/pallas_dplr_recurrent.py: state
checkpoints every 64 tokens, the backward replays each chunk from its checkpoint and walks it
in reverse).

Per sequence and head, state S [K, V] fp32, P = S_{t-1}, e = exp(w_t):
    sa = a_t^T P;  S_t = diag(e) P + b_t sa + k_t v_t^T;  o_t = scale S_t^T r_t
Backward of one token, dS the gradient w.r.t. S_t (o_t's part scale r_t do_t^T added first):
    dr = scale S_t do;  dk = dS v;  dv = dS^T k;  dsa = dS^T b;  db = dS sa^T;  da = P dsa;
    dw = e * rowsum(P * dS);  dS_{t-1} = diag(e) dS + a dsa^T
dw is formed per token from P and dS of that token: O(e) terms only, no cancellation.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.pallas_dplr_recurrent import KROW, QK, Family, run_recurrent


def _step(S, x, scale):
    sa = jnp.sum(x["a"][:, None] * S, axis=0)
    S = (jnp.exp(x["w"])[:, None] * S + x["b"][:, None] * sa[None, :]
         + x["k"][:, None] * x["v"][None, :])
    return S, scale * jnp.sum(x["r"][:, None] * S, axis=0)


def _step_bwd(P, dS, x, do, scale):
    e = jnp.exp(x["w"])
    a, b, k, v = x["a"], x["b"], x["k"], x["v"]
    sa = jnp.sum(a[:, None] * P, axis=0)
    St = e[:, None] * P + b[:, None] * sa[None, :] + k[:, None] * v[None, :]
    dS = dS + (scale * x["r"])[:, None] * do[None, :]
    dsa = jnp.sum(b[:, None] * dS, axis=0)
    grads = {"r": scale * jnp.sum(St * do[None, :], axis=1),
             "w": e * jnp.sum(P * dS, axis=1),
             "k": jnp.sum(dS * v[None, :], axis=1),
             "a": jnp.sum(P * dsa[None, :], axis=1),
             "b": jnp.sum(dS * sa[None, :], axis=1)}
    dv = jnp.sum(k[:, None] * dS, axis=0)
    return e[:, None] * dS + a[:, None] * dsa[None, :], grads, dv


RWKV7 = Family("rwkv7", (("r", QK), ("w", KROW), ("k", QK), ("a", KROW), ("b", KROW)),
               _step, _step_bwd)


def fused_recurrent_rwkv7_pallas(r, k, v, *, w, a, b, scale, initial_state=None,
                                 output_final_state=False, cu_seqlens=None):
    """Pallas token-by-token RWKV-7.

    Args:
        r, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in {bf16, fp16, fp32}.
        w, a, b: [B, T, H, K] fp32 (w the per-key log-decay). scale: float.
        initial_state: None or [N, H, K, V] fp32. cu_seqlens: None or int [N+1] (B == 1;
        may be traced).
    Returns:
        o [B, T, H, V] in r's dtype; final_state [N, H, K, V] fp32 (None unless
        output_final_state). Differentiable w.r.t. r, w, k, v, a, b, initial_state.
    """
    f32 = jnp.float32
    return run_recurrent(RWKV7, {"r": r, "w": w.astype(f32), "k": k, "a": a.astype(f32),
                                 "b": b.astype(f32)}, v,
                         scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
