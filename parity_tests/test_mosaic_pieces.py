"""The delta family's sequence split (fla_jax/ops/gated_delta_rule/mosaic_pieces.py) on a CPU
machine: the policy and tables, the piece scans against sequential float64 loops, the map pass
(mosaic_map_ws.py, interpreted) against a float64 token recurrence, the whole op split into
pieces against the harness's float64 oracle (interpreted: forward and every gradient), and the
split's kernels lowering for CUDA.
"""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ShapeDtypeStruct as S

from fla_jax.ops.common.mosaic import export_for_cuda
from fla_jax.ops.common.mosaic.tiles import gpu_interpret, transposed_load_lowers
from fla_jax.ops.gated_delta_rule import chunk_gated_delta_rule, mosaic_chunk, mosaic_pieces
from fla_jax.ops.gated_delta_rule.mosaic_layout import gate_free_inverse, gate_vectors
from fla_jax.ops.gated_delta_rule.mosaic_map_ws import piece_maps

from .harness import assert_passed, check

C = 64


def test_policy():
    """Split only calls with few CTAs (N * HV * V / 64 <= 32 for N sequences), into a power of
    two of pieces filling one wave of 132 SMs, at most 8 (more than 4 only with >= 32 chunks
    a piece), each >= 8 chunks (varlen: the mean); (K + V) / 64 even (row-block pairs)."""
    bf = jnp.bfloat16
    assert mosaic_pieces.pieces(1, 16, 128, 128, 512, bf) == 4     # B1 T32768 H16
    assert mosaic_pieces.pieces(4, 16, 128, 128, 64, bf) == 1      # 128 CTAs already
    assert mosaic_pieces.pieces(1, 2, 128, 128, 256, bf) == 8      # gpu_t16k
    assert mosaic_pieces.pieces(1, 2, 128, 128, 128, bf) == 4      # 32 chunks a piece
    assert mosaic_pieces.pieces(1, 2, 128, 128, 16, bf) == 2
    assert mosaic_pieces.pieces(1, 2, 128, 128, 8, bf) == 1
    assert mosaic_pieces.pieces(5, 4, 128, 128, 7, bf) == 1        # gpu_varlen: 40 CTAs
    assert mosaic_pieces.pieces(1, 2, 64, 128, 256, bf) == 1       # 3 row blocks
    assert mosaic_pieces.pieces(1, 2, 256, 256, 256, bf) == 1      # K > 128


def _seq_table(*rows):
    """The passes' sequence table from (first chunk, chunk count) rows."""
    t = np.zeros((len(rows), 32), np.int32)
    t[:, :2] = rows
    return jnp.asarray(t)


def test_tables():
    """Each sequence (a row of the passes' table; varlen: any lengths, empty ones too) in
    pieces of ceil(count / P) chunks (the last ones shorter or empty); the map pass walks E of
    pieces 0 .. P-2 and M of pieces 1 .. P-2 (+ 0 with an initial state, + P-1 for the
    backward); the reverse pass from zero skips each sequence's first piece. Works on a traced
    table (jit)."""
    seq = _seq_table((0, 5), (5, 5))
    t = np.asarray(jax.jit(lambda x: mosaic_pieces.piece_table(x, 4))(seq))
    assert t.shape == (8, 32) and not t[:, 2:].any()
    assert t[:, :2].tolist() == [[0, 2], [2, 2], [4, 1], [5, 0], [5, 2], [7, 2], [9, 1],
                                 [10, 0]]
    t = np.asarray(mosaic_pieces.piece_table(_seq_table((0, 3), (4, 0), (5, 9)), 2))
    assert t[:, :2].tolist() == [[0, 2], [2, 1], [4, 0], [4, 0], [5, 5], [10, 4]]
    t = np.asarray(mosaic_pieces.piece_table(_seq_table((0, 8)), 2, skip_first=True))
    assert t[:, :2].tolist() == [[0, 0], [4, 4]]
    seq = _seq_table((0, 8))
    m = np.asarray(mosaic_pieces.map_table(seq, 4, first_map=False, last_map=False))
    assert m[:, :3].tolist() == [[0, 2, 0], [2, 2, 2], [4, 2, 2], [6, 0, 0]]
    m = np.asarray(mosaic_pieces.map_table(seq, 4, first_map=True, last_map=True))
    assert m[:, :3].tolist() == [[0, 2, 2], [2, 2, 2], [4, 2, 2], [6, 0, 2]]


def test_bad_scan_refused(monkeypatch):
    """A bad mosaic_pieces.SCAN is refused at the op's entry and at use."""
    monkeypatch.setattr(mosaic_pieces, "SCAN", "loop")
    x = jnp.zeros((1, 1, 4, 4), jnp.float32)
    with pytest.raises(ValueError, match="SCAN: got 'loop'"):
        mosaic_pieces.forward_starts(jnp.zeros((2, 1, 8, 4)), x, 1, 2, 4)
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    b = jnp.ones((1, 64, 1), jnp.float32)
    with gpu_interpret(), pytest.raises(ValueError, match="SCAN: got 'loop'"):
        mosaic_chunk.chunk_gated_delta_rule_mosaic(q, q, q, g=b, beta=b, scale=1.0,
                                                   initial_state=None,
                                                   output_final_state=False, cu_seqlens=None)


SCAN_CASES = [("dot", 2, 4, 3, 8, 5),
              # the Mosaic kernel (interpreted) at head sizes it takes: two value blocks, P = 4
              # (the peeled zero start + the loop) and P = 2 (the peeled step alone)
              ("kernel", 1, 4, 1, 64, 128), ("kernel", 2, 2, 1, 128, 64)]


@pytest.mark.parametrize("scan,B,P,HV,K,V", SCAN_CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_scans_against_sequential_loops(with_state, scan, B, P, HV, K, V, monkeypatch):
    """forward_starts / backward_ends against float64 loops over the pieces (S [K, V]:
    S_{p+1} = M_p S_p + E_p; dS_start = M_p^T dS_end + F_p); the maps' rows :K hold M^T. The
    maps nobody reads (M_0 without a start state, M_{P-1} forward, E_{P-1}) are NaN: a scan
    that reads them fails. Error bound: fp32 accumulation (a bf16 product is ~1e-3 off)."""
    monkeypatch.setattr(mosaic_pieces, "SCAN", scan)
    rng = np.random.default_rng(0)
    M = rng.standard_normal((B, P, HV, K, K)) / (2 * np.sqrt(K))
    E = rng.standard_normal((B, P, HV, K, V))
    maps = np.concatenate([np.swapaxes(M, -1, -2), np.swapaxes(E, -1, -2)], axis=-2)
    fwd_maps = maps.copy()
    fwd_maps[:, P - 1] = np.nan
    if not with_state:
        fwd_maps[:, 0, :, :K] = np.nan
    h0 = rng.standard_normal((B, HV, K, V)) if with_state else np.zeros((B, HV, K, V))
    ctx = gpu_interpret if scan == "kernel" else contextlib.nullcontext

    def close(got, want):
        err = np.max(np.abs(got - want)) / np.max(np.abs(want))
        assert err < 2e-6, err

    with ctx():
        starts = mosaic_pieces.forward_starts(
            jnp.asarray(fwd_maps.reshape(B * P, HV, K + V, K), jnp.float32),
            jnp.asarray(np.swapaxes(h0, -1, -2), jnp.float32) if with_state else None, B, P, K)
    s, want = h0, []
    for p in range(P):
        want.append(np.swapaxes(s, -1, -2))
        s = np.einsum("bhij,bhjv->bhiv", M[:, p], s) + E[:, p]
    close(np.asarray(starts).reshape(B, P, HV, V, K), np.stack(want, 1))
    F = rng.standard_normal((B, P, HV, K, V))
    dht = rng.standard_normal((B, HV, K, V)) if with_state else np.zeros((B, HV, K, V))
    bwd_maps = maps[..., :K, :].copy()
    bwd_maps[:, 0] = np.nan
    F_in = np.swapaxes(F, -1, -2).copy()
    F_in[:, 0] = np.nan
    if not with_state:
        bwd_maps[:, P - 1] = np.nan
    with ctx():
        ends = mosaic_pieces.backward_ends(
            jnp.asarray(F_in.reshape(B * P, HV, V, K), jnp.float32),
            jnp.asarray(bwd_maps.reshape(B * P, HV, K, K), jnp.float32),
            jnp.asarray(np.swapaxes(dht, -1, -2), jnp.float32) if with_state else None, B, P, K)
    d, want = dht, [None] * P
    for p in reversed(range(P)):
        want[p] = np.swapaxes(d, -1, -2)
        d = np.einsum("bhji,bhjv->bhiv", M[:, p], d) + F[:, p]
    close(np.asarray(ends).reshape(B, P, HV, V, K), np.stack(want, 1))


def _maps_float64(k, v, g, beta, table, group):
    """[M^T ; E^T] per piece by the token recurrence in float64: from [I | 0] with values
    [0 | v], S <- exp(g_t) S, S <- S + beta_t k_t (v_t - S^T k_t)^T, over the piece's value-
    block chunks for E and identity-block chunks for M (both the larger count when K / 64 is
    odd: one CTA carries an identity and a value block)."""
    R, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    out = np.zeros((table.shape[0], HV, K + V, K))
    for p, (first, cval, cid) in enumerate(table[:, :3]):
        if K // C % 2:
            cval = cid = max(cval, cid)
        for hv in range(HV):
            for part, count in (("M", cid), ("E", cval)):
                s = np.eye(K, K + V) if part == "M" else np.zeros((K, K + V))
                for t in range(first * C, (first + count) * C):
                    kt = k[t, hv // group]
                    vt = np.concatenate([np.zeros(K), v[t, hv]])
                    s = np.exp(g[t, hv]) * s
                    s = s + beta[t, hv] * np.outer(kt, vt - s.T @ kt)
                rows = slice(0, K) if part == "M" else slice(K, K + V)
                out[p, hv, rows] = s.T[rows]
    return out


@pytest.mark.parametrize("K,nc,P,later_in_kernel", [(64, 5, 4, False), (128, 3, 2, False),
                                                    (64, 5, 4, True)])
def test_map_pass_against_float64(K, nc, P, later_in_kernel, monkeypatch):
    """mosaic_map_ws.piece_maps (interpreted) against the float64 recurrence: GQA (2 value
    heads on 1 key head); K = V = 64: an identity block paired with a value block (both walk
    the larger count), pieces of 2, 2, 1, 0 chunks; K = V = 128: pairs of identity blocks
    and of value blocks, pieces of 2, 1 chunks, M skipped in the first piece and E in the last
    (rows of I and 0 stay). Relative RMS within bf16 rounding of the 16-bit operands (the
    state is cast for each product); fails when the identity start or the decays are dropped.
    later_in_kernel: mosaic_fwd_ws.LATER_IN_KERNEL (the update decay from G, no G_last - G
    vector: None is passed for it)."""
    from fla_jax.ops.gated_delta_rule import mosaic_fwd_ws
    monkeypatch.setattr(mosaic_fwd_ws, "LATER_IN_KERNEL", later_in_kernel)
    rng = np.random.default_rng(4)
    H, HV, V = 1, 2, K
    R = nc * C
    k = rng.standard_normal((R, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((R, HV, V))
    g = -rng.uniform(0.0, 0.1, (R, HV))
    beta = rng.uniform(0.1, 1.0, (R, HV))
    kq, vq = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    table = mosaic_pieces.map_table(_seq_table((0, nc)), P, first_map=False, last_map=False)
    G, later = gate_vectors(jnp.asarray(g, jnp.float32), R, HV)
    b32 = jnp.asarray(beta, jnp.float32)
    with gpu_interpret():
        t0, = gate_free_inverse(kq, b32.T, HV // H, jnp.bfloat16)
        got = np.asarray(piece_maps(kq, vq, t0, G, None if later_in_kernel else later, b32.T,
                                    table), np.float64)
    ref = _maps_float64(np.asarray(kq.astype(jnp.float32), np.float64),
                        np.asarray(vq.astype(jnp.float32), np.float64), g, beta,
                        np.asarray(table), HV // H)
    err = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2))
    assert err < 1e-2, err
    # blocks that walk nothing hold their start exactly: rows of I (M) and 0 (E)
    eye = np.broadcast_to(np.eye(K), (HV, K, K))
    np.testing.assert_array_equal(got[-1, :, K:], 0.0)
    if K == 128:        # pairs of one kind: piece 0 walks no M, the last piece nothing
        np.testing.assert_array_equal(got[0, :, :K], eye)
        np.testing.assert_array_equal(got[-1, :, :K], eye)
    else:               # the mixed pair walks max(2, 0) in piece 0, nothing in piece 3
        assert np.abs(got[0, :, :K] - eye).max() > 0.5
        np.testing.assert_array_equal(got[-1, :, :K], eye)


@pytest.fixture
def spy_split(monkeypatch):
    """Pieces down to one chunk; records the piece count of every split forward."""
    from fla_jax.ops.gated_delta_rule import mosaic_fwd_ws
    monkeypatch.setattr(mosaic_pieces, "MIN_PIECE_CHUNKS", 1)
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    # CI time: two input stages (the third is interpreted in test_mosaic_delta_lowering.py)
    monkeypatch.setattr(mosaic_fwd_ws, "MAX_STAGES", 2)
    seen = []

    def maps(*a, **kw):
        seen.append(a[-1].shape[0])
        return piece_maps(*a, **kw)
    monkeypatch.setattr(mosaic_chunk, "piece_maps", maps)
    return seen


@pytest.mark.parametrize("op,case,dtype,rows", [
    ("chunk_gated_delta_rule", "mos_dr_split", "bf16", 4),    # B = 1, P = 4: 2, 2, 1, 0
    # varlen, sequences of 60 and 90 tokens (1 and 2 chunks): P = 2
    ("chunk_delta_rule", "mos_dr_strong", "fp16", 4)])
def test_split_interpreted_against_float64(op, case, dtype, rows, spy_split):
    """The op split into pieces (forward, final state and every gradient, incl. dh0) against
    the harness's float64 oracle, interpreted; the split ran (N * P piece rows)."""
    with gpu_interpret():
        assert_passed(check(op, case, dtype, {"jax": "mosaic"}))
    assert spy_split and set(spy_split) == {rows}


@pytest.mark.parametrize("varlen", [False, True])
def test_split_lowers(varlen):
    """B=1 T=4096 HV=4 (8 CTAs; varlen: 2 sequences, 16 CTAs): 4 pieces; the forward and the
    vjp lower with the map pass and the reverse pass without stores."""
    B, T, H, HV, K, N = 1, 4096, 2, 4, 128, 2 if varlen else 1
    dt, f32 = jnp.bfloat16, jnp.float32
    args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, HV, K), dt), S((B, T, HV), f32),
            S((B, T, HV), f32), S((N, HV, K, K), f32)]
    assert mosaic_pieces.pieces(N, HV, K, K, T // C // N + varlen, dt) == 4
    cu = jnp.asarray([0, 1000, T], jnp.int32) if varlen else None

    def f(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                      output_final_state=True, impl="mosaic")

    def fb(*a):
        (o, ht), vjp = jax.vjp(f, *a)
        return o, ht, vjp((jnp.ones_like(o), jnp.ones_like(ht)))
    assert "gdn_map_ws" in export_for_cuda(f, *args)
    text = export_for_cuda(fb, *args)
    assert "gdn_map_ws" in text and "gdn_bwd_states_ws_nostore" in text


def test_nostore_run_by_the_storing_kernel(spy_split, monkeypatch):
    """mosaic_bwd.NOSTORE_RUN = "storing" (opt-in): the split's first reverse run by the storing
    kernel (tiles discarded): interpreted against float64 and no no-store kernel lowered; a bad
    choice is named."""
    from fla_jax.ops.gated_delta_rule import mosaic_bwd
    monkeypatch.setattr(mosaic_bwd, "NOSTORE_RUN", "storing")
    with gpu_interpret():
        assert_passed(check("chunk_gated_delta_rule", "mos_dr_split", "bf16", {"jax": "mosaic"}))
    assert set(spy_split) == {4}
    B, T, H, HV, K = 1, 4096, 2, 4, 128        # split into 4 pieces (test_split_lowers)
    dt, f32 = jnp.bfloat16, jnp.float32
    assert mosaic_pieces.pieces(1, HV, K, K, T // C, dt) == 4
    args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, HV, K), dt), S((B, T, HV), f32),
            S((B, T, HV), f32)]

    def fb(q, k, v, g, beta):
        o, vjp = jax.vjp(lambda *a: chunk_gated_delta_rule(*a, impl="mosaic")[0],
                         q, k, v, g, beta)
        return vjp(jnp.ones_like(o))
    text = export_for_cuda(fb, *args)
    assert "gdn_map_ws" in text and "gdn_bwd_states_ws" in text
    assert "gdn_bwd_states_ws_nostore" not in text
    monkeypatch.setattr(mosaic_bwd, "NOSTORE_RUN", "none")
    with pytest.raises(ValueError, match="NOSTORE_RUN='none'"):
        export_for_cuda(lambda *a: fb(*a), *args)     # a new function: traced anew


def test_piece_scan_refuses_bad_inputs():
    """The scan kernel names a non-fp32 operand and a head size it cannot take."""
    from fla_jax.ops.gated_delta_rule.mosaic_piece_scan import piece_scan
    m = jnp.zeros((4, 1, 128, 64), jnp.float32)
    with pytest.raises(TypeError, match="must be float32; got bfloat16"):
        piece_scan(m.astype(jnp.bfloat16), m, None, N=1, P=4, K=64, x_row=64, backward=False)
    m32 = jnp.zeros((4, 1, 64, 32), jnp.float32)
    with pytest.raises(ValueError, match="K=32"):
        piece_scan(m32, m32, None, N=1, P=4, K=32, x_row=32, backward=False)


@pytest.mark.parametrize("scales,dvl_in_prep", [("registers", True), ("smem", True)])
def test_reverse_pass_variants_interpreted(scales, dvl_in_prep, spy_split, monkeypatch):
    """The reverse-pass variants (mosaic_bwd_states_ws.OPERAND_SCALES, DVL_IN_PREP: the default,
    and "smem", what jax < 0.11 lowers, which ignores DVL_IN_PREP), interpreted in
    the split op (the reverse pass with stores over the pieces and the no-store run) against the
    float64 oracle, fp16's tight tolerances."""
    from fla_jax.ops.gated_delta_rule import mosaic_bwd_states_ws as rs
    assert (rs.OPERAND_SCALES, rs.DVL_IN_PREP) == ("registers", True)
    monkeypatch.setattr(rs, "OPERAND_SCALES", scales)
    monkeypatch.setattr(rs, "DVL_IN_PREP", dvl_in_prep)
    with gpu_interpret():
        regs = scales == "registers"
        assert rs.plan(128, jnp.float16, store=False) == (3 if regs else 2, scales)
        assert rs.plan(128, jnp.float16, store=True) == (2, scales)
        assert_passed(check("chunk_gated_delta_rule", "mos_dr_split", "fp16", {"jax": "mosaic"}))
    assert set(spy_split) == {4}
    if not transposed_load_lowers():    # jax < 0.11 lowers "smem" regardless (2 stages)
        assert rs.plan(128, jnp.float16, store=False) == (rs.STAGES, "smem")
