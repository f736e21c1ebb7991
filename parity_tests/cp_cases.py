"""Context-parallel cases: a sequence split along T over several devices (JAX) / ranks (torch)
must give the single-device op's outputs, final states and gradients (dh0 included).

Used by test_context_parallel_torch.py and test_context_parallel_jax.py (via cp_jax_worker).
Gates are weak (per token -0.05 * [0.05, 1]) so a state carried across a split still
matters at the far end of a slice: a wrong or dropped carry fails the check.
"""
from __future__ import annotations

import numpy as np

from .cases import (ACTIVATION, BETA, GATE, GATE_K, OPS, Case, make_inputs, rel_rms, seed_of,
                    tolerance)

CP_FAMILIES = ("simple_gla", "gla", "delta_rule", "gated_delta_rule")
CP_DTYPES = ("fp32", "bf16")
# T = 192: 4 slices of 48 or 2 of 96 (not multiples of the 64-token chunk). cp_varlen:
# [20, 144) crosses three boundaries at 4 slices (covers slices 1 and 2 whole, ends on a
# boundary), 144 starts a sequence on a boundary, an empty sequence at 20.
CP_CASES = (
    Case("cp_batch", B=2, T=192, strength=0.05, gate_mode="both", l2norm=True,
         families=CP_FAMILIES),
    Case("cp_varlen", B=1, T=192, cu_seqlens=(0, 20, 20, 144, 170, 192), strength=0.05,
         families=CP_FAMILIES),
)
PER_TOKEN = (ACTIVATION, GATE, GATE_K, BETA)


def runs():
    """(case, spec, dtype) for every CP check: fp32 for both cases, bf16 for the varlen one."""
    return [(c, OPS[f"chunk_{f}"], d) for c in CP_CASES for f in CP_FAMILIES for d in CP_DTYPES
            if d == "fp32" or c.cu_seqlens is not None]


def world_runs(full: int, extra: int):
    """(world, case, spec, dtype): every run split over `full` devices / ranks, and the
    varlen case in fp32 of one diagonal-decay and one delta-rule op over `extra`."""
    out = [(full, *r) for r in runs()]
    return out + [(extra, *r) for r in runs() if r[0].cu_seqlens is not None
                  and r[2] == "fp32" and r[1].family in ("gla", "gated_delta_rule")]


def run_id(case, spec, dtype) -> str:
    return f"{spec.name}-{case.name}-{dtype}"


def inputs(spec, case, dtype, round_to) -> dict:
    """float64 numpy inputs (make_inputs), activations and do rounded to dtype, the rest to
    fp32. round_to(dtype, array) -> float64 array."""
    x = make_inputs(spec, case, seed_of("cp", spec.name, case.name))
    act = {a.key for a in spec.activations} | {"do"}
    return {n: round_to(dtype if n in act else "fp32", a) for n, a in x.items()}


def slice_of(spec, x: dict, rank: int, world: int, T: int) -> dict:
    """The rank's part: per-token tensors [B, T, ...] sliced along T, the rest whole."""
    Tl = T // world
    sl = slice(rank * Tl, (rank + 1) * Tl)
    out = {}
    for a in spec.args:
        if a.key in x:
            out[a.key] = x[a.key][:, sl] if a.role in PER_TOKEN else x[a.key]
    out["do"] = x["do"][:, sl]
    out["dht"] = x["dht"]
    return out


def compare(cp: dict, single: dict, oracle: dict, dtype: str) -> list:
    """Rows (name, err vs single device, err vs float64, tolerance, passed). fp32: CP vs the
    single-device op within the table; bf16: CP vs float64 and vs the single-device op within
    the table. Errors: RMS(a - b) / RMS(float64)."""
    if set(cp) != set(single):
        raise AssertionError(f"CP results {sorted(cp)} != single-device {sorted(single)}")
    rows = []
    for name in sorted(single):
        tol = tolerance(dtype, name)
        e_single = rel_rms(cp[name], single[name], oracle[name])
        e_oracle = rel_rms(cp[name], oracle[name], oracle[name])
        ok = e_single <= tol and (dtype == "fp32" or e_oracle <= tol)
        rows.append((name, e_single, e_oracle, tol, ok))
    return rows


def failures(rows) -> list:
    return [f"{n}: vs single {es:.2e}, vs fp64 {eo:.2e} (tol {t:.0e})"
            for n, es, eo, t, ok in rows if not ok]


def assemble(spec, parts: list) -> dict:
    """Global results from per-rank dicts (rank order): o and per-token gradients joined
    along T; ht and dh0 must agree on every rank (rank 0's is returned)."""
    per_token = {"o"} | {"d" + a.key for a in spec.args if a.role in PER_TOKEN}
    out = {}
    for name in parts[0]:
        if name in per_token:
            out[name] = np.concatenate([p[name] for p in parts], axis=1)
        else:
            for r, p in enumerate(parts[1:], 1):
                if not np.array_equal(p[name], parts[0][name]):
                    err = np.max(np.abs(p[name] - parts[0][name]))
                    raise AssertionError(f"{spec.name}: {name} differs between rank 0 and "
                                         f"rank {r} (max |diff| {err:.2e})")
            out[name] = parts[0][name]
    return out
