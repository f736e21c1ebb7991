"""Context parallelism: one sequence split along T across the ranks of a torch.distributed group.

`chunk_simple_gla`, `chunk_gla`, `chunk_delta_rule` and `chunk_gated_delta_rule` take
`cp_group=`; each rank then passes its own slice of the sequence (rank r holds global tokens
[r T, (r + 1) T), T the same on every rank) and gets the outputs of that slice, equal to the
single-device op's. The state map of a slice is affine in the state entering it:
    S_out = A S_in + B        A: [HV, K, K] (simple GLA / GLA: diagonal), B: [HV, K, V]
Each rank runs the op on its slice with a zero entering state (B: its final state), forms A
and Q~_t = scale q_t P_t (P_t: the transition product from the slice start to token t, so
that o_t(S_in) = o_t(0) + Q~_t S_in), all-gathers [A | B] over the group
(torch.distributed.nn.functional.all_gather, autograd-aware), folds the earlier ranks' maps
into its entering state and adds Q~ S_in to its outputs.
  - simple GLA / GLA: P_t = diag(exp(cumsum of the log-decay)), formed elementwise (cheap).
  - delta rule / GDN: P_t is a [K, K] product; Q~ and A come from a second run of the op with
    v = 0 and initial state I ([K, K], so V = K): its outputs are Q~, its final state A.
    Cost: one more op call (forward and backward) with V = K columns on ranks > 0.
The backward is autograd through the op calls and the collectives (exact).

Arguments on a rank (shapes of the op, with T the local length):
  q, k: [B, T, H, K] ...; cu_seqlens: None or the GLOBAL packed offsets [N + 1] (B == 1,
  ending at world * T; sequences may cross rank boundaries); initial_state: None or the
  global [N, HV, K, V] fp32, the same on every rank. Returns (o [B, T, HV, V] for the local
  slice, final_state [N, HV, K, V] fp32 for every sequence, the same on every rank, or None).
Gradients: the loss is the sum of every rank's loss (torch.distributed's convention): each
rank gets its slice's dq, dk, dv, dg, dbeta, and every rank gets the whole dh0; the
final_state's gradient is the sum of the ranks' cotangents for it.
"""
from __future__ import annotations

from bisect import bisect_right

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from ... import dtypes

DIAGONAL_FAMILIES = ("simple_gla", "gla")
CP_FAMILIES = ("simple_gla", "gla", "delta_rule", "gated_delta_rule")


class _WholeGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (a replicated input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllGather(torch.autograd.Function):
    """all_gather over the group; backward: each part's gradient summed over the group
    (all_reduce of the stacked parts), the own part kept. torch.distributed.nn's all_gather
    backward fails under gloo on a group that is not ranks 0..n-1 of the world (its gloo
    all-to-all path passes group ranks as global ranks), as a cp group of dp x cp has."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        stacked = torch.stack([g.contiguous() for g in grads])
        dist.all_reduce(stacked, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def _plan(cu, rank, world, B, T):
    """Host-side boundaries of the local slice. cu: list of global offsets or None."""
    s, e = rank * T, (rank + 1) * T
    if cu is None:
        return dict(local_cu=None, cont=rank > 0, e_c=T, n_c=None, n_tail=None,
                    starts=[rank == 0] * B, own=[rank == world - 1] * B)
    n_c = bisect_right(cu, s) - 1
    cont = cu[n_c] < s
    N = len(cu) - 1
    own = []
    for n in range(N):
        if cu[n] == cu[n + 1]:
            own.append(rank == 0)
        else:
            own.append(s <= cu[n + 1] - 1 < e)
    return dict(local_cu=[min(max(c - s, 0), T) for c in cu], cont=cont,
                e_c=min(cu[n_c + 1] - s, T) if cont else 0, n_c=n_c,
                n_tail=bisect_right(cu, e - 1) - 1, starts=[c >= s for c in cu[:-1]], own=own)


def _diagonal_transition(family, q, gates, scale, e_c, gd):
    """Q~ [B, T, H, K] and A [B, H, K, K] over local tokens [0, e_c) for a diagonal decay."""
    B, T, H, K = q.shape
    if family == "gla":
        logd = gates["g"].to(gd)                                        # [B, T, H, K]
    else:
        logd = torch.zeros(B, T, H, dtype=gd, device=q.device)
        if gates.get("g") is not None:
            logd = logd + gates["g"].to(gd)
        if gates.get("g_gamma") is not None:
            logd = logd + gates["g_gamma"].to(gd)
        logd = logd[..., None]                                          # [B, T, H, 1]
    inside = (torch.arange(T, device=q.device) < e_c).to(gd)[None, :, None, None]
    G = torch.cumsum(logd * inside, dim=1)
    qt = scale * q.to(gd) * torch.exp(G) * inside                       # [B, T, H, K]
    a = torch.exp(G[:, -1]).expand(B, H, K)
    return qt, torch.diag_embed(a)


def _delta_transition(op, q, k, gates, scale, e_c, varlen, impl, gd):
    """Q~ [B, T, HV, K] and A [B', HV, K, K] from the op run with v = 0 and initial state I."""
    B, T, H, K = q.shape
    HV = gates["beta"].shape[2]
    v0 = torch.zeros(B, T, HV, K, dtype=q.dtype, device=q.device)
    eye = torch.eye(K, dtype=gd, device=q.device).expand(HV, K, K)
    if varlen:
        h0 = torch.stack([eye, torch.zeros_like(eye)])
        cu2 = torch.tensor([0, e_c, T], dtype=torch.int32, device=q.device)
    else:
        h0, cu2 = eye.expand(B, HV, K, K).contiguous(), None
    qt, a = op(q, k, v0, **gates, scale=scale, initial_state=h0, output_final_state=True,
               cu_seqlens=cu2, impl=impl)
    return qt, (a[:1] if varlen else a)


def chunk_context_parallel(family, op, group, q, k, v, *, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None, impl="auto", **gates):
    """Run the chunk op `op` (the public function, called without cp_group) of `family` on
    this rank's slice of a sequence split over `group`. Arguments and returns: the op's, as
    the module docstring says (cu_seqlens / initial_state / final_state are global)."""
    if family not in CP_FAMILIES:
        raise ValueError(f"cp_group: context parallelism covers {CP_FAMILIES}; got {family!r}")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"chunk_{family}: cp_group={group!r}; expected a "
                        f"torch.distributed.ProcessGroup (e.g. dist.group.WORLD)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, T, H, K = q.shape
    cu = None
    if cu_seqlens is not None:
        cu = [int(c) for c in cu_seqlens.detach().cpu().tolist()]
        if cu and cu[-1] != world * T:
            raise ValueError(f"chunk_{family}: cu_seqlens ends at {cu[-1]}; with cp_group it "
                             f"holds the global offsets and must end at world * T = "
                             f"{world} * {T} = {world * T}")
    p = _plan(cu, rank, world, B, T)
    gd = dtypes.gate_dtype(q.dtype)
    if scale is None:
        scale = K ** -0.5
    h0 = initial_state
    if h0 is not None:
        if h0.requires_grad:
            h0 = _WholeGradient.apply(h0, group)
        keep = torch.tensor(p["starts"], dtype=h0.dtype, device=h0.device)
        h0 = h0 * keep[:, None, None, None]
    local_cu = None
    if cu is not None:
        local_cu = torch.tensor(p["local_cu"], dtype=cu_seqlens.dtype, device=cu_seqlens.device)

    o, final = op(q, k, v, **gates, scale=scale, initial_state=h0, output_final_state=True,
                  cu_seqlens=local_cu, impl=impl)
    varlen = cu is not None
    HV, V = final.shape[1], final.shape[3]
    rows = 1 if varlen else B
    if p["cont"]:
        if family in DIAGONAL_FAMILIES:
            qt, a = _diagonal_transition(family, q, gates, scale, p["e_c"], gd)
            a = a[:rows]
        else:
            qt, a = _delta_transition(op, q, k, gates, scale, p["e_c"], varlen, impl, gd)
    else:
        qt, a = None, torch.eye(K, dtype=gd, device=q.device).expand(rows, HV, K, K)
    through = p["cont"] and p["e_c"] == T
    a_map = a if through else torch.zeros_like(a)
    b_map = final[p["n_tail"]:p["n_tail"] + 1] if varlen else final
    with warnings.catch_warnings():   # torch >= 2.12 calls these deprecated; still autograd-aware
        warnings.simplefilter("ignore", FutureWarning)
        parts = _AllGather.apply(torch.cat([a_map, b_map], dim=-1).contiguous(), group)

    carry = torch.zeros(rows, HV, K, V, dtype=gd, device=q.device)
    for j in range(rank):
        carry = parts[j][..., :K] @ carry + parts[j][..., K:]
    if p["cont"]:
        corr = torch.einsum("bthk,bhkv->bthv", qt.to(gd), carry)
        o = (o.to(gd) + corr).to(q.dtype)
    # Every rank's output depends on every gathered part (with a zero weight where unused),
    # so every rank runs the all-gather's backward, a collective that all ranks must enter.
    o = o + (0.0 * torch.stack(parts).sum()).to(o.dtype)
    if not output_final_state:
        return o, None
    if p["cont"]:
        tail = a @ carry                                                # [rows, HV, K, V]
        if varlen:
            onehot = torch.zeros(final.shape[0], dtype=gd, device=q.device)
            onehot[p["n_c"]] = 1.0
            final = final + onehot[:, None, None, None] * tail
        else:
            final = final + tail
    own = torch.tensor(p["own"], dtype=gd, device=q.device)[:, None, None, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return o, dist_nn.all_reduce(final * own, group=group)
