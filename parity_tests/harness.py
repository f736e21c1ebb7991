"""The parity engine shared by the pytest suite and the CLI.

`check(op, case, dtype, impls)` draws the case's inputs once (float64, seeded), rounds them to
the dtype under test, runs every requested (framework, impl), runs the float64 oracle (fla_torch
reference with autograd, in float64, on the same rounded values), and returns one Row per
compared tensor: each implementation against the oracle, and JAX against torch directly.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from .cases import CASES, OPS, TENSORS, family_spec, make_inputs, rel_rms, seed_of, tolerance

FRAMEWORKS = ("jax", "torch")
KERNEL = {"jax": "pallas", "torch": "triton"}
# --impls mosaic: fla_jax's Pallas Mosaic GPU kernels (Hopper only), checked against float64 and
# against fla_torch's Triton kernels
MOSAIC = {"jax": "mosaic", "torch": "triton"}


@dataclass
class Row:
    op: str
    case: str
    dtype: str
    compared: str
    tensor: str
    error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance

    def as_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def _runner(framework: str):
    if framework == "torch":
        from . import torch_runner
        return torch_runner
    from . import jax_runner
    return jax_runner


def default_impl(op: str) -> str:
    """The implementation a CPU user gets from impl='auto' for a chunk_* op ('chunked'); for a
    fused_recurrent_* op the token-by-token 'reference' is what the CPU path checks; softmax
    attention's engine through impl='auto' (SDPA; XLA, or cuDNN on a GPU)."""
    if not OPS[op].has_state:
        return "auto"       # softmax attention: the engine impl='auto' picks
    return "chunked" if OPS[op].variant == "chunk" else "reference"


def resolve(framework: str, op: str, impl: str) -> str | None:
    """'default' | 'kernel' | 'mosaic' | a concrete name -> the impl name, or None if not
    registered."""
    spec = OPS[op]
    if impl == "default":
        impl = default_impl(op)
    elif impl == "kernel":
        impl = KERNEL[framework]
    elif impl == "mosaic":
        impl = MOSAIC[framework]
    return impl if impl == "auto" or impl in _runner(framework).registry(spec) else None


def cannot_take(op: str, case: str, dtype: str, impls: dict) -> str | None:
    """Why one of impls ({framework: impl}) cannot take this cell ("framework:impl: reason", the
    first one), or None. Limits beyond registration are the runner's (`unsupported`: e.g. the
    Mosaic kernels' dtypes, head sizes and GPU)."""
    for fw, impl in impls.items():
        limits = getattr(_runner(fw), "unsupported", None)
        why = limits and limits(OPS[op], CASES[case], impl, dtype)
        if why:
            return f"{fw}:{impl}: {why}"
    return None


def inputs(op: str, case: str, dtype: str) -> dict:
    """The rounded float64 inputs every implementation of `op` gets for (case, dtype)."""
    return _family_inputs(OPS[op].family, case, dtype)


@functools.lru_cache(maxsize=64)
def _family_inputs(family: str, case: str, dtype: str):
    """Inputs depend on the family only: chunk_* and fused_recurrent_* see the same values."""
    from .torch_runner import round_to
    spec, c = family_spec(family), CASES[case]
    raw = make_inputs(spec, c, seed_of(family, case))
    act = {a.key for a in spec.activations} | {"do"}
    return {n: round_to(dtype if n in act else "fp32", a) for n, a in raw.items()}


def oracle(op: str, case: str, dtype: str, device: str = "cpu") -> dict:
    """The float64 oracle on the rounded inputs: fla_torch's token-by-token reference on CPU;
    on a GPU run, fla_torch's chunked path in float64 on the GPU (proven equal to the reference
    to ~1e-10 in float64 by test_chunked_fp64_torch.py), since a Python token loop over
    T = 4096 is too slow. Shared by the chunk_* and fused_recurrent_* ops of one family. Softmax
    attention: its float64 reference (a materialised softmax) on either device."""
    return _oracle(family_spec(OPS[op].family).name, case, dtype, device)


# test_ops.py orders its rows by (family, case, dtype), so a family's chunk_* and
# fused_recurrent_* rows of both kinds reuse one oracle run in a worker (in op-major order the
# token loop ran again for most of them); 64 entries keep a few groups for the files after it.
@functools.lru_cache(maxsize=64)
def _oracle(op: str, case: str, dtype: str, device: str) -> dict:
    from . import torch_runner
    impl = "reference" if device == "cpu" or not OPS[op].has_state else "chunked"
    return torch_runner.run(OPS[op], CASES[case], impl, "fp64", inputs(op, case, dtype),
                            device=device)


def check(op: str, case: str, dtype: str, impls: dict, device: str = "cpu",
          outputs: dict | None = None) -> list[Row]:
    """impls: {'jax': impl, 'torch': impl}; a framework left out is not run. outputs: a dict
    that receives each framework's results ({'jax': {'o': ..., 'ht': ...}}) for further checks."""
    spec, c = OPS[op], CASES[case]
    if not c.applies_to(spec):
        raise ValueError(f"case {case} does not apply to {op}")
    x = inputs(op, case, dtype)
    ref = oracle(op, case, dtype, device)
    results = {}
    for fw, impl in impls.items():
        results[fw] = (impl, _runner(fw).run(spec, c, impl, dtype, x, device=device))
        if outputs is not None:
            outputs[fw] = results[fw][1]
    compared = [t for t in TENSORS if t in ref] + [t for t in ref if t not in TENSORS]
    rows = []
    for fw, (impl, res) in results.items():
        for t in compared:
            rows.append(Row(op, case, dtype, f"{fw}:{impl} vs fp64", t,
                            rel_rms(res[t], ref[t], ref[t]), tolerance(dtype, t)))
    if len(results) == 2:
        (ij, rj), (it, rt) = results["jax"], results["torch"]
        for t in compared:
            rows.append(Row(op, case, dtype, f"jax:{ij} vs torch:{it}", t,
                            rel_rms(rj[t], rt[t], ref[t]), tolerance(dtype, t, cross=True)))
    return rows


def check_no_final_state(op: str, case: str, dtype: str, impls: dict,
                         device: str = "cpu") -> list[Row]:
    """output_final_state=False: each implementation returns no final state, and its output and
    every gradient match the float64 oracle's with a zero final-state cotangent."""
    import numpy as np

    from . import torch_runner
    spec, c = OPS[op], CASES[case]
    x = dict(inputs(op, case, dtype))
    finals = [a.final_key for a in spec.states]
    for n in finals:
        x["d" + n] = np.zeros_like(x["d" + n])
    impl = "reference" if device == "cpu" or not spec.has_state else "chunked"
    ref = torch_runner.run(family_spec(spec.family), c, impl, "fp64", x, device=device)
    compared = [t for t in TENSORS if t in ref and t not in finals]
    rows = []
    for fw, fw_impl in impls.items():
        res = _runner(fw).run(spec, c, fw_impl, dtype, x, device=device, final_state=False)
        rows += [Row(op, case, dtype, f"{fw}:{fw_impl} vs fp64 (no final state)", t,
                     rel_rms(res[t], ref[t], ref[t]), tolerance(dtype, t)) for t in compared]
    return rows


def assert_passed(rows: list[Row]) -> None:
    """Fail naming every row over its tolerance (and fail on no rows at all)."""
    bad = [f"{r.op} {r.case} {r.dtype} {r.compared} {r.tensor}: err={r.error:.3e} "
           f"tol={r.tolerance:.1e}" for r in rows if not r.passed]
    assert rows and not bad, "\n".join(bad)
