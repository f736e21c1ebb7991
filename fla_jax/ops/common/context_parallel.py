"""Context parallelism: one sequence split along T across a mesh axis, inside `shard_map`.

`chunk_simple_gla`, `chunk_gla`, `chunk_delta_rule` and `chunk_gated_delta_rule` take
`cp_mesh_axis=` (a mesh axis name of the enclosing `jax.shard_map`); each device then passes
its own slice of the sequence (device r along the axis holds global tokens [r T, (r + 1) T),
in_specs P(None, axis) on q, k, v, g, beta) and gets the outputs of that slice, equal to the
single-device op's. The state map of a slice is affine in the state entering it:
    S_out = A S_in + B        A: [HV, K, K] (simple GLA / GLA: diagonal), B: [HV, K, V]
Each device runs the op on its slice with a zero entering state (B: its final state), forms A
and Q~_t = scale q_t P_t (P_t: the transition product from the slice start to token t, so
that o_t(S_in) = o_t(0) + Q~_t S_in), all-gathers [A | B] over the axis (`lax.all_gather`),
folds the earlier devices' maps into its entering state and adds Q~ S_in to its outputs.
  - simple GLA / GLA: P_t = diag(exp(cumsum of the log-decay)), formed elementwise (cheap).
  - delta rule / GDN: P_t is a [K, K] product; Q~ and A come from a second run of the op with
    v = 0 and initial state I ([K, K], so V = K): its outputs are Q~, its final state A.
    Cost: one more op call (forward and backward) with V = K columns.
The backward is JAX autodiff through the op calls and the collectives (exact).

Arguments on a device (shapes of the op, with T the local length): cu_seqlens: None or the
GLOBAL packed offsets [N + 1] (B == 1, ending at axis_size * T, replicated: in_specs P();
may be traced; sequences may cross device boundaries); initial_state: None or the global
[N, HV, K, V] fp32, replicated. Returns (o [B, T, HV, V] for the local slice, final_state
[N, HV, K, V] fp32, the same on every device (out_specs P()), or None).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ... import dtypes
from .prepare import concrete_values

DIAGONAL_FAMILIES = ("simple_gla", "gla")
CP_FAMILIES = ("simple_gla", "gla", "delta_rule", "gated_delta_rule")


def _axis_size(axis):
    if hasattr(lax, "axis_size"):
        return lax.axis_size(axis)
    return lax.psum(1, axis)


def _plan(cu, rank, world, B, T):
    """Traced boundaries of the local slice. cu: global offsets [N + 1] or None."""
    s = rank * T
    if cu is None:
        return dict(local_cu=None, cont=rank > 0, e_c=T, n_c=None, n_tail=None,
                    starts=jnp.broadcast_to(rank == 0, (B,)),
                    own=jnp.broadcast_to(rank == world - 1, (B,)))
    cu = cu.astype(jnp.int32)
    n_c = jnp.searchsorted(cu, s, side="right") - 1
    cont = cu[n_c] < s
    e_c = jnp.where(cont, jnp.minimum(cu[n_c + 1] - s, T), 0)
    last = cu[1:] - 1
    own = jnp.where(cu[1:] > cu[:-1], (last >= s) & (last < s + T), rank == 0)
    return dict(local_cu=jnp.clip(cu - s, 0, T), cont=cont, e_c=e_c, n_c=n_c,
                n_tail=jnp.searchsorted(cu, s + T - 1, side="right") - 1,
                starts=cu[:-1] >= s, own=own)


def _diagonal_transition(family, q, gates, scale, e_c, gd):
    """Q~ [B, T, H, K] and A [B, H, K, K] over local tokens [0, e_c) for a diagonal decay."""
    B, T, H, K = q.shape
    if family == "gla":
        logd = gates["g"].astype(gd)                                    # [B, T, H, K]
    else:
        logd = jnp.zeros((B, T, H), gd)
        if gates.get("g") is not None:
            logd = logd + gates["g"].astype(gd)
        if gates.get("g_gamma") is not None:
            logd = logd + gates["g_gamma"].astype(gd)
        logd = logd[..., None]                                          # [B, T, H, 1]
    inside = (jnp.arange(T) < e_c).astype(gd)[None, :, None, None]
    G = jnp.cumsum(logd * inside, axis=1)
    qt = scale * q.astype(gd) * jnp.exp(G) * inside                     # [B, T, H, K]
    a = jnp.broadcast_to(jnp.exp(G[:, -1]), (B, H, K))
    return qt, a[..., :, None] * jnp.eye(K, dtype=gd)


def _varying(x, rank):
    """x marked as varying over the mesh axis (as the slices are), so that a scan carrying it
    next to per-device values type-checks under shard_map's check_vma; values unchanged."""
    return jnp.where(rank >= 0, x, jnp.zeros_like(x))


def _delta_transition(op, q, k, gates, scale, e_c, varlen, impl, gd, rank):
    """Q~ [B, T, HV, K] and A [B', HV, K, K] from the op run with v = 0 and initial state I."""
    B, T, H, K = q.shape
    HV = gates["beta"].shape[2]
    v0 = jnp.zeros((B, T, HV, K), q.dtype)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=gd), (HV, K, K))
    if varlen:
        h0 = jnp.stack([eye, jnp.zeros_like(eye)])
        cu2 = jnp.stack([jnp.int32(0), jnp.asarray(e_c, jnp.int32), jnp.int32(T)])
    else:
        h0, cu2 = jnp.broadcast_to(eye, (B, HV, K, K)), None
    qt, a = op(q, k, v0, **gates, scale=scale, initial_state=_varying(h0, rank),
               output_final_state=True,
               cu_seqlens=cu2, impl=impl)
    return qt, (a[:1] if varlen else a)


def chunk_context_parallel(family, op, axis, q, k, v, *, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None, impl="auto", **gates):
    """Run the chunk op `op` (the public function, called without cp_mesh_axis) of `family`
    on this device's slice of a sequence split over mesh axis `axis` (inside shard_map).
    Arguments and returns: the op's, as the module docstring says (cu_seqlens /
    initial_state / final_state are global)."""
    if family not in CP_FAMILIES:
        raise ValueError(f"cp_mesh_axis: context parallelism covers {CP_FAMILIES}; "
                         f"got {family!r}")
    try:
        world = _axis_size(axis)
        rank = lax.axis_index(axis)
    except NameError as err:
        raise ValueError(f"chunk_{family}: cp_mesh_axis={axis!r} is not a mesh axis of an "
                         f"enclosing shard_map ({err})") from None
    B, T, H, K = q.shape
    varlen = cu_seqlens is not None
    if varlen:
        values = concrete_values(cu_seqlens)
        if values is not None and values.size and int(values[-1]) != world * T:
            raise ValueError(f"chunk_{family}: cu_seqlens ends at {int(values[-1])}; with "
                             f"cp_mesh_axis it holds the global offsets and must end at "
                             f"axis size * T = {world} * {T} = {world * T}")
    p = _plan(cu_seqlens, rank, world, B, T)
    gd = dtypes.gate_dtype(q.dtype)
    prec = dtypes.matmul_precision()
    if scale is None:
        scale = K ** -0.5
    h0 = initial_state
    if h0 is None:   # explicit zeros: a scan carry made inside the op would not be varying
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        h0 = jnp.zeros((N, v.shape[2], K, v.shape[3]), gd)
    h0 = _varying(jnp.where(p["starts"][:, None, None, None], h0, jnp.zeros_like(h0)), rank)
    local_cu = p["local_cu"]
    if local_cu is not None:
        local_cu = local_cu.astype(cu_seqlens.dtype)

    o, final = op(q, k, v, **gates, scale=scale, initial_state=h0, output_final_state=True,
                  cu_seqlens=local_cu, impl=impl)
    HV, V = final.shape[1], final.shape[3]
    rows = 1 if varlen else B
    if family in DIAGONAL_FAMILIES:
        qt, a = _diagonal_transition(family, q, gates, scale, p["e_c"], gd)
        a = a[:rows]
    else:
        qt, a = _delta_transition(op, q, k, gates, scale, p["e_c"], varlen, impl, gd,
                                  rank)
    through = p["cont"] & (p["e_c"] == T)
    a_map = jnp.where(through, a, jnp.zeros_like(a))
    b_map = lax.dynamic_index_in_dim(final, p["n_tail"], 0, keepdims=True) if varlen else final
    parts = lax.all_gather(jnp.concatenate([a_map, b_map], axis=-1), axis)  # [W, rows, HV, K, K+V]

    carries = [jnp.zeros((rows, HV, K, V), gd)]
    for j in range(world - 1):
        carries.append(jnp.matmul(parts[j, ..., :K], carries[-1], precision=prec)
                       + parts[j, ..., K:])
    carry = jnp.where(p["cont"], jnp.stack(carries)[rank], 0.0)
    corr = jnp.einsum("bthk,bhkv->bthv", qt.astype(gd), carry, precision=prec)
    o = jnp.where(p["cont"], (o.astype(gd) + corr).astype(q.dtype), o)
    if not output_final_state:
        return o, None
    tail = jnp.matmul(a, carry, precision=prec)                          # [rows, HV, K, V]
    if varlen:
        hit = (jnp.arange(final.shape[0]) == p["n_c"]) & p["cont"]
        final = final + jnp.where(hit[:, None, None, None], tail, 0.0)
    else:
        final = final + jnp.where(p["cont"], tail, 0.0)
    contrib = jnp.where(p["own"][:, None, None, None], final, 0.0)
    return o, lax.psum(contrib, axis)
