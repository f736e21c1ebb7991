"""The gate vectors and beta rows of the delta family's Mosaic kernels, formed by one small kernel
instead of XLA glue.

The Mosaic kernels read, per value head, [HV, R] fp32 rows (chunks of C consecutive rows):
    G      the chunk-local cumsum of g, in log2 units,
    later  G_last - G (the sum over the later rows of the chunk), in log2 units,
    beta^T
from g_rows, beta_rows [R, HV] fp32 (token-major). XLA forms them with four kernels (H200 profile,
RESULTS.md run 28: the transpose + cumsum 4.4 us, beta's transpose 2.1, the log2e / G_last - G
multiply 2.0, G_last's slice 1.7; for the delta rule, g = None, a zero fill and beta's
transpose), and every launch adds its gap to the forward (GDN B4 T4096: 6 launches against
jla's 5). GATES = "kernel" (the default where it applies) forms all three in one Pallas kernel
(Triton lowering; interpreted on CPU): one program per chunk loads the chunk's [C, HV] tiles of
g and beta (coalesced), takes the cumsum over the chunk's rows and writes the three [HV, C]
blocks transposed. G and later are computed as the XLA formulation does (cumsum, G_last taken
from the cumsum's last row, the same subtraction and log2e scaling; only the cumsum's summation
order may differ: fp32 rounding). GATES = "xla": mosaic_layout.gate_vectors and a transpose
(also used where the kernel does not apply: HV not a power of two, or > MAX_HV).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..common.pallas_triton import compiler_params, interpret
from .mosaic_fwd_kernel import C
from .mosaic_layout import LOG2E, gate_vectors

F32 = jnp.float32
GATES = "kernel"
GATES_CHOICES = ("kernel", "xla")
MAX_HV = 128


def kernel_applies(HV: int) -> bool:
    """The one-kernel path takes HV a power of two up to MAX_HV (Triton block shapes)."""
    return 1 <= HV <= MAX_HV and HV & (HV - 1) == 0


def _body(*refs, gated: bool):
    if gated:
        g_ref, b_ref, gc_ref, gs_ref, bt_ref = refs
    else:
        b_ref, gc_ref, gs_ref, bt_ref = refs
    b = b_ref[...]                                        # [C, HV]
    bt_ref[...] = b.T
    if not gated:
        zero = jnp.zeros(bt_ref.shape, F32)
        gc_ref[...] = zero
        gs_ref[...] = zero
        return
    x = g_ref[...]
    G = jnp.cumsum(x, axis=0)
    row = jax.lax.broadcasted_iota(jnp.int32, G.shape, 0)
    last = jnp.max(jnp.where(row == C - 1, G, -jnp.inf), axis=0)      # G's last row, exactly
    gc_ref[...] = (G * LOG2E).T
    gs_ref[...] = ((last[None, :] - G) * LOG2E).T


def gate_inputs(g_rows, beta_rows):
    """g_rows: None or [R, HV] fp32 log-decay (natural log); beta_rows: [R, HV] fp32 (R a
    multiple of C). Returns (G, G_last - G, beta^T), each [HV, R] fp32 (G and G_last - G zero
    without g)."""
    R, HV = beta_rows.shape
    if GATES not in GATES_CHOICES:
        raise ValueError(f"mosaic_gates.GATES={GATES!r}; expected one of {GATES_CHOICES}")
    if beta_rows.dtype != F32 or (g_rows is not None and (g_rows.shape != (R, HV)
                                                          or g_rows.dtype != F32)) or R % C:
        raise ValueError(f"gate_inputs: beta_rows {beta_rows.shape} {beta_rows.dtype}, g_rows "
                         f"{None if g_rows is None else (g_rows.shape, g_rows.dtype)}; "
                         f"expected [R, HV] float32 (R % {C} == 0), g_rows None or the same")
    if GATES == "xla" or not kernel_applies(HV):
        G, later = gate_vectors(g_rows, R, HV)
        return G, later, beta_rows.T
    gated = g_rows is not None
    tile = pl.BlockSpec((C, HV), lambda i: (i, 0))
    out = pl.BlockSpec((HV, C), lambda i: (0, i))
    vec = jax.ShapeDtypeStruct((HV, R), F32)
    call = pl.pallas_call(
        lambda *refs: _body(*refs, gated=gated), out_shape=(vec, vec, vec), grid=(R // C,),
        in_specs=[tile, tile] if gated else [tile], out_specs=(out, out, out),
        compiler_params=compiler_params(num_warps=2, num_stages=1), interpret=interpret(),
        name="gdn_gate_rows")
    return call(*((g_rows, beta_rows) if gated else (beta_rows,)))
