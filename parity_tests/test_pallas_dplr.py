"""Kernel tests of the Pallas DPLR chunk pipeline (chunk_kda, chunk_rwkv7 on
fla_jax/ops/common/engine/dplr*.py) on CPU, interpreted: the features test_ops' kernel subset
does not reach, as a case list on the shared harness (cases.Case / make_inputs, the fp64
oracle of torch_runner, jax_runner under jax.jit with traced cu_seqlens, cases.rel_rms and THE
tolerance table).

KDA: grouped value heads with l2norm, varlen with an empty and sub-chunk sequences, head sizes
that are not powers of two (K = 48, V = 24), gates down to -20 per token and channel.
RWKV-7: a = -kk, b = kk * u as its layer draws them, gates in [-20, -10] over two chunks
(dw's cancellation-free assembly), fp16 without an initial state. Few, small cases: the
interpreter compiles each shape once (this file stays within 90 s on an idle core).
"""
from __future__ import annotations

import pytest

from . import jax_runner, torch_runner
from .cases import OPS, Case, make_inputs, rel_rms, seed_of, tolerance

CASES = (
    ("chunk_kda", Case("kda_gqa_l2_varlen", B=1, T=90, H=1, HV=2, K=48, V=24, l2norm=True,
                       cu_seqlens=(0, 0, 10, 90), strength=20.0, families=("kda",)), "fp32"),
    ("chunk_kda", Case("kda_basic_bf16", B=2, T=40, K=32, V=32, families=("kda",)), "bf16"),
    ("chunk_rwkv7", Case("rwkv7_uniform_strong", B=1, T=100, K=32, V=32, cu_seqlens=(0, 70, 100),
                         strength=20.0, floor=0.5, families=("rwkv7",)), "fp32"),
    ("chunk_rwkv7", Case("rwkv7_fp16_no_h0", B=2, T=40, K=32, V=16, h0=False,
                         families=("rwkv7",)), "fp16"),
)


def _inputs(op: str, case: Case, dtype: str) -> dict:
    spec = OPS[op]
    raw = make_inputs(spec, case, seed_of("pallas_dplr", case.name))
    act = {a.key for a in spec.activations} | {"do"}
    return {n: torch_runner.round_to(dtype if n in act else "fp32", a) for n, a in raw.items()}


@pytest.mark.parametrize("op,case,dtype", [pytest.param(o, c, d, id=f"{c.name}-{d}")
                                           for o, c, d in CASES])
def test_pallas_dplr(op, case, dtype):
    spec = OPS[op]
    x = _inputs(op, case, dtype)
    ref = torch_runner.run(spec, case, "reference", "fp64", x)
    got = jax_runner.run(spec, case, "pallas", dtype, x)
    errs = {t: (rel_rms(got[t], ref[t], ref[t]), tolerance(dtype, t)) for t in ref}
    bad = {t: e for t, e in errs.items() if not e[0] <= e[1]}
    assert not bad, f"{op} {case.name} {dtype}: (error, tolerance) over tolerance {bad}; all {errs}"
