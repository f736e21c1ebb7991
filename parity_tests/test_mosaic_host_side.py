"""The XLA (host) side of the delta family's Mosaic path, on a CPU machine: the gate vectors
(mosaic_layout.gate_vectors, both ways of forming G_last - G) against float64, and the
sequence / piece tables (mosaic_layout.plan, mosaic_pieces): numpy constants for fixed length
(no XLA kernels per call to form them), the same tables as jax arrays from a traced (varlen)
table."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.gated_delta_rule import mosaic_layout, mosaic_pieces
from fla_jax.ops.gated_delta_rule.mosaic_fwd_kernel import C, TABLE_WIDTH


@pytest.mark.parametrize("later", ["difference", "sum"])
def test_gate_vectors_against_float64(later, monkeypatch):
    """G (chunk-local cumsum) and G_last - G in log2 units, [HV, R], under strong gates (up
    to -8 a token: |G| ~ 740 at a chunk's end), within fp32 rounding of |G_last|."""
    monkeypatch.setattr(mosaic_layout, "LATER", later)
    rng = np.random.default_rng(0)
    R, HV = 4 * C, 3
    g = -rng.uniform(0.0, 8.0, (R, HV))
    G, rest = jax.jit(lambda x: mosaic_layout.gate_vectors(x, R, HV))(jnp.asarray(g, jnp.float32))
    gc = np.asarray(jnp.asarray(g, jnp.float32), np.float64).T.reshape(HV, R // C, C)
    want_G = np.cumsum(gc, -1) * np.log2(np.e)
    want_rest = (want_G[..., -1:] - want_G)
    scale = np.abs(want_G[..., -1:])            # |G_last| per chunk
    for got, want in ((G, want_G), (rest, want_rest)):
        got = np.asarray(got, np.float64).reshape(HV, R // C, C)
        assert np.all(np.abs(got - want) <= 2e-6 * scale + 1e-6), np.max(np.abs(got - want))
    assert np.all(np.asarray(rest).reshape(HV, R // C, C)[..., -1] == 0)


def test_gate_vectors_rejects_unknown_later(monkeypatch):
    monkeypatch.setattr(mosaic_layout, "LATER", "scan")
    with pytest.raises(ValueError, match="LATER='scan'"):
        mosaic_layout.gate_vectors(jnp.zeros((C, 2), jnp.float32), C, 2)


def test_fixed_length_tables_are_numpy_constants():
    """plan() gives fixed-length calls a numpy table, and every piece table formed from it is
    numpy with the values the jax path gives for the same table (the varlen path's)."""
    lay, table = mosaic_layout.plan(3, 10 * C + 5, None)
    assert isinstance(table, np.ndarray) and table.dtype == np.int32
    assert table.shape == (3, TABLE_WIDTH)
    np.testing.assert_array_equal(table[:, :2], [[0, 11], [11, 11], [22, 11]])
    traced = jnp.asarray(table)
    for P in (2, 4):
        cases = [
            (lambda t: mosaic_pieces.piece_table(t, P)),
            (lambda t: mosaic_pieces.piece_table(t, P, skip_first=True)),
            (lambda t: mosaic_pieces.piece_table(t, P, skip_last=True)),
        ] + [(lambda t, f=f, la=la: mosaic_pieces.map_table(t, P, first_map=f, last_map=la))
             for f in (False, True) for la in (False, True)]
        for fn in cases:
            got = fn(table)
            assert isinstance(got, np.ndarray) and got.dtype == np.int32
            want = jax.jit(fn)(traced)                   # the traced (varlen) path
            np.testing.assert_array_equal(got, np.asarray(want))
    # what the tables say: pieces of ceil(11 / 4) = 3 chunks; the last piece's end unread
    ptab = mosaic_pieces.piece_table(table, 4)
    np.testing.assert_array_equal(ptab[:4, :2], [[0, 3], [3, 3], [6, 3], [9, 2]])
    np.testing.assert_array_equal(mosaic_pieces.piece_table(table, 4, skip_last=True)[:4, 1],
                                  [3, 3, 3, 0])
    mt = mosaic_pieces.map_table(table, 4, first_map=False, last_map=False)
    np.testing.assert_array_equal(mt[:4, :3], [[0, 3, 0], [3, 3, 3], [6, 3, 3], [9, 0, 0]])


def test_lane_all_sets_lane_semantics_for_every_kernel(monkeypatch):
    """tiles.LANE_ALL (the default): compiler_params gives Lane semantics whatever a kernel
    asks; off, a kernel's own choice (jax's default unless lane=True)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from fla_jax.ops.common.mosaic import tiles
    lane = plgpu.LoweringSemantics.Lane
    assert tiles.LANE_ALL
    p = tiles.compiler_params(True)
    assert p.lowering_semantics == lane and p.approx_math
    monkeypatch.setattr(tiles, "LANE_ALL", False)
    assert tiles.compiler_params(True, lane=True).lowering_semantics == lane
    default = plgpu.CompilerParams().lowering_semantics
    assert tiles.compiler_params(True).lowering_semantics == default
