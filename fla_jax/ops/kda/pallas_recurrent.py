"""Token-by-token Kimi Delta Attention as Pallas kernels (Triton lowering; interpreted on
CPU), forward and backward, on the DPLR recurrent driver
(fla_jax/ops/common/pallas_dplr_recurrent.py: state checkpoints every 64 tokens, the backward
replays each chunk from its checkpoint and walks it in reverse).

Per sequence and value head hv (q/k head hv // (HV // H)), state S [K, V] fp32, e = exp(g_t):
    S' = diag(e) S;  u = v_t - S'^T k_t;  S_t = S' + beta_t k_t u^T;  o_t = scale S_t^T q_t
Backward of one token, dS the gradient w.r.t. S_t (o_t's part scale q_t do_t^T added first):
    dq = scale S_t do;  du = beta dS^T k (= dv);  dbeta = k . (dS u);
    dk = beta dS u - S' du;  dS' = dS - k du^T;  dg = rowsum(S' * dS');  dS_{t-1} = diag(e) dS'
dg is formed per token from S' = diag(e) S_{t-1} itself: O(e) terms only, no cancellation.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.pallas_dplr_recurrent import KROW, QK, SCALAR, Family, run_recurrent


def _step(S, x, scale):
    Sp = jnp.exp(x["g"])[:, None] * S
    u = x["v"] - jnp.sum(x["k"][:, None] * Sp, axis=0)
    S = Sp + (x["beta"] * x["k"])[:, None] * u[None, :]
    return S, scale * jnp.sum(x["q"][:, None] * S, axis=0)


def _step_bwd(P, dS, x, do, scale):
    q, k, beta = x["q"], x["k"], x["beta"]
    e = jnp.exp(x["g"])
    Sp = e[:, None] * P
    u = x["v"] - jnp.sum(k[:, None] * Sp, axis=0)
    bk = beta * k
    St = Sp + bk[:, None] * u[None, :]
    dS = dS + (scale * q)[:, None] * do[None, :]
    du = jnp.sum(bk[:, None] * dS, axis=0)
    dSu = jnp.sum(dS * u[None, :], axis=1)
    dSp = dS - k[:, None] * du[None, :]
    grads = {"q": scale * jnp.sum(St * do[None, :], axis=1),
             "k": beta * dSu - jnp.sum(Sp * du[None, :], axis=1),
             "g": jnp.sum(Sp * dSp, axis=1),
             "beta": jnp.sum(k * dSu)}
    return e[:, None] * dSp, grads, du


KDA = Family("kda", (("q", QK), ("k", QK), ("g", KROW), ("beta", SCALAR)), _step, _step_bwd)


def fused_recurrent_kda_pallas(q, k, v, *, g, beta, scale, initial_state=None,
                               output_final_state=False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False):
    """Pallas token-by-token KDA.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0); one dtype in {bf16, fp16, fp32}.
        g: [B, T, HV, K] fp32 per-key log-decay; beta: [B, T, HV] fp32. scale: float.
        initial_state: None or [N, HV, K, V] fp32. cu_seqlens: None or int [N+1] (B == 1;
        may be traced). use_qk_l2norm_in_kernel: normalise q, k over K (fp32) in the kernel.
    Returns:
        o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] fp32 (None unless
        output_final_state). Differentiable w.r.t. q, k, v, g, beta, initial_state.
    """
    return run_recurrent(KDA, {"q": q, "k": k, "g": g.astype(jnp.float32),
                               "beta": beta.astype(jnp.float32)}, v,
                         scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                         l2norm=use_qk_l2norm_in_kernel)
