"""Kernel tests of the Pallas DPLR chunk pipeline (chunk_kda through chunk_kda_pallas_dplr,
chunk_rwkv7, on fla_jax/ops/common/engine/dplr*.py) on CPU, interpreted: the features test_ops' kernel subset
does not reach, as a case list on the shared harness (cases.PALLAS_DPLR_CASES, harness.check:
the fp64 oracle, jax_runner under jax.jit with traced cu_seqlens, cases.rel_rms and THE
tolerance table).

KDA: grouped value heads with l2norm, varlen with an empty and sub-chunk sequences, head sizes
that are not powers of two (K = 48, V = 24), gates down to -20 per token and channel.
RWKV-7: a = -kk, b = kk * u as its layer draws them, gates in [-20, -10] over two chunks
(dw's cancellation-free assembly), fp16 without an initial state. Few, small cases: the
interpreter compiles each shape once (this file stays within 90 s on an idle core).
"""
from __future__ import annotations

import pytest

from .harness import assert_passed, check

ROWS = [("chunk_kda", "pdplr_kda_gqa_l2_varlen", "fp32"),
        ("chunk_kda", "pdplr_kda_basic", "bf16"),
        ("chunk_rwkv7", "pdplr_rwkv7_uniform_strong", "fp32"),
        ("chunk_rwkv7", "pdplr_rwkv7_no_h0", "fp16")]


@pytest.mark.parametrize("op,case,dtype", [pytest.param(*r, id=f"{r[1]}-{r[2]}") for r in ROWS])
def test_pallas_dplr(op, case, dtype, monkeypatch):
    if op == "chunk_kda":
        # impl='pallas' runs KDA on the delta-rule stages (test_pallas_kda.py); these rows keep
        # the DPLR route (chunk_kda_pallas_dplr) checked
        from fla_jax.ops.kda import interface
        monkeypatch.setitem(interface.CHUNK_IMPLS, "pallas",
                            "fla_jax.ops.kda.pallas_chunk:chunk_kda_pallas_dplr")
    assert_passed(check(op, case, dtype, {"jax": "pallas"}))
