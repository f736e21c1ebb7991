"""Pallas simple-GLA kernels (chunk_simple_gla, fused_recurrent_simple_gla): the cases that
test_ops.py's CPU kernel subset leaves out, as a case list on the shared harness (cases.Case /
make_inputs, harness.check: the float64 oracle, jax_runner under jax.jit with traced cu_seqlens,
cases.rel_rms and the one tolerance table).

Covered here: g / g_gamma / both / no gate, no initial state, B = 2, varlen with empty and
sub-chunk sequences, K != V and head sizes 16..256 (100: not a power of two), weak to -20
per-token gates (fp32 dg under gates in [-20, -1] and [-20, -10]), every case in fp32 / bf16 /
fp16; and the kernels' tilings other than the default one (16-token chunks, several K / V blocks
of the register state, an unmasked T = 128), set through the modules' TUNING for one row.
Interpreted Pallas outputs start NaN-filled, so an unwritten element fails. With a GPU backend
the same rows run the compiled kernels.
"""
from __future__ import annotations

import contextlib

import pytest

from fla_jax.ops.common.engine import scan
from fla_jax.ops.simple_gla import pallas_recurrent

from .cases import interpreted_dtypes
from .harness import assert_passed, check

ALL = ("fp32", "bf16", "fp16")


@contextlib.contextmanager
def tuning(module, settings):
    """module.TUNING updated with `settings` (read when an op is traced), restored after."""
    old = dict(module.TUNING)
    module.TUNING.update(settings)
    try:
        yield
    finally:
        module.TUNING.clear()
        module.TUNING.update(old)


def _rows(*entries):
    """(case, dtypes, tuning) -> pytest params (case, dtype, tuning); interpreted on CPU, fp32
    and one of bf16 / fp16 per entry (cases.interpreted_dtypes)"""
    return [pytest.param(c, d, t, id=f"{c}-{d}" + "".join(f"-{k}{v}" for k, v in t.items()))
            for i, (c, dts, t) in enumerate(entries) for d in interpreted_dtypes(i, dts)]


# test_ops.py's kernel subset already runs basic (bf16), varlen / gamma (fp32) and
# short_strong (fp16) with the default tiling.
CHUNK = _rows(
    ("sgla_b2_kv", ALL, {}), ("sgla_b2_kv", ALL, {"bt": 16}),
    ("sgla_t150_both", ALL, {}), ("sgla_t128", ALL, {"state_elems": 256}),
    ("sgla_gamma_no_h0", ALL, {}), ("sgla_both_kv", ALL, {}), ("sgla_plain", ALL, {}),
    ("sgla_varlen_both", ALL, {}), ("sgla_varlen_b", ALL, {"bt": 16}),
    ("sgla_k100", ALL, {"state_elems": 1024}), ("sgla_k256_v24", ALL, {}),
    ("sgla_k16_v256", ALL, {}), ("sgla_uniform_strong_long", ("fp32",), {}),
)
RECURRENT = _rows(
    ("sgla_rec_kv", ALL, {}), ("sgla_rec_k100_v40", ALL, {"state_elems": 1024}),
    ("sgla_rec_plain", ALL, {}), ("sgla_rec_varlen", ALL, {}),
    ("sgla_strong_long", ("fp32",), {}),
)


@pytest.mark.parametrize("case,dtype,settings", CHUNK)
def test_chunk_simple_gla_pallas(case, dtype, settings):
    with tuning(scan, settings):
        assert_passed(check("chunk_simple_gla", case, dtype, {"jax": "pallas"}))


@pytest.mark.parametrize("case,dtype,settings", RECURRENT)
def test_fused_recurrent_simple_gla_pallas(case, dtype, settings):
    with tuning(pallas_recurrent, settings):
        assert_passed(check("fused_recurrent_simple_gla", case, dtype, {"jax": "pallas"}))


@pytest.mark.parametrize("dtype,K,V,fwd,bwd", [
    ("bfloat16", 128, 128, 3, 3), ("float32", 128, 128, 2, 2),   # the tuned defaults stay
    ("bfloat16", 64, 256, 3, 3),
    ("float32", 64, 256, 2, 1),    # dq / dk: v and do of all of V; 2 stages asked 336 KB (H100)
    ("float32", 256, 64, 1, 1)])   # q, k of all of K: fwd 276 KB / dv 337 KB at 2 (sm_90 offline)
def test_scan_stages_fit_shared_memory(dtype, K, V, fwd, bwd):
    import jax
    import jax.numpy as jnp
    q = jax.ShapeDtypeStruct((1, 64, 1, K), jnp.dtype(dtype))
    v = jax.ShapeDtypeStruct((1, 64, 1, V), jnp.dtype(dtype))
    st = scan.make_static(q, v, None, None, None, None, 1.0)
    assert (st.fwd_stages, st.bwd_stages) == (fwd, bwd)
