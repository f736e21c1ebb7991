"""Every Triton kernel launch of every op compiles for sm_90 (H100) on this CPU machine.

The interpreter runs programs the compiler rejects (a value re-bound to another shape in an
`if`, a loop-carried value that changes type: both passed CI and failed on the H100), so each op
with a Triton implementation is called here forward and backward at a varlen case in every
kernel dtype and at a fixed-length case with h0 in bf16 (CASE_DTYPES), with its launches
recorded instead of run (parity_tests/triton_compile_check.py), and every distinct launch is
compiled in a process without TRITON_INTERPRET through the LLVM lowering. A failure names the
kernel, its constexprs, the ops / cases / dtypes that launch it and the compiler's error.

Distinct is over all ops together (`compile_key`: kernel, signature, constexpr values, launch
options): a launch that several ops make (the GLA engine kernels GSA runs, the cumsum KDA and
GSA share), or launches that differ only in a runtime int's or float's value, compile once; an
fp16 launch that is a bf16 launch with its pointers' element type renamed folds into it. The
distinct launches are dealt round-robin (in key order, so each kernel's variants spread out) to
SHARDS compile tests, which `-n 2` balances; every worker records the same launches and takes
its shards' share, and compiles them in one checker process it keeps for this module
(triton_compile_check.Checker: the process start and imports once, not per shard).
test_triton_launches_recorded checks, per op, that every (case, dtype) call launched kernels.
"""
from __future__ import annotations

import functools

import pytest

from .cases import CASES, OPS
from .harness import inputs
from .torch_runner import registry, run
from .triton_compile_check import Checker, compile_key, distinct, record_launches

DTYPES = ("bf16", "fp16", "fp32")
# A kernel's fixed-length and varlen launches differ only in IS_VARLEN (and cu_seqlens' type):
# every dtype's variant compiles at varlen and the IS_VARLEN=False branch in bf16; the other
# two dtypes' fixed-length twins (92 of 330 distinct launches, ~2 min of CI) compiled the same
# branch again with other element types, which the varlen launches already compile.
CASE_DTYPES = {"varlen": DTYPES, "basic": ("bf16",)}
SHARDS = 16


def _triton_ops():
    for op, spec in OPS.items():
        try:
            impls = registry(spec)
        except ModuleNotFoundError:
            continue
        if "triton" in impls:
            yield op


TRITON_OPS = list(_triton_ops())


@functools.cache
def _record(op: str):
    """([(case, dtype, launches)], records): op's launches in each case and dtype, each
    record labelled with 'where' = op/case/dtype."""
    spec, runs, records = OPS[op], [], []
    for name, dtypes in CASE_DTYPES.items():
        case = CASES[name]
        if not case.applies_to(spec):
            continue
        for dtype in dtypes:
            with record_launches() as rec:
                try:
                    run(spec, case, "triton", dtype, inputs(op, name, dtype))
                except AssertionError:
                    pass   # outputs of kernels that did not run: only the launches count
            for r in rec:
                r["where"] = [f"{op}/{name}/{dtype}"]
            records += rec
            runs.append((name, dtype, len(rec)))
    return runs, records


@functools.cache
def _distinct_launches() -> list:
    """The distinct launches of every Triton op, sorted by compile_key (the same list in
    every xdist worker)."""
    launches = distinct([r for op in TRITON_OPS for r in _record(op)[1]])
    # An fp16 launch whose every other part (kernel, constexprs, options, other pointers) equals
    # a bf16 launch's is the same program with 16-bit element types renamed: no Triton kernel of
    # fla_torch branches on fp16 vs bf16 inside the kernel (grep tl.float16 / tl.bfloat16: none;
    # KDA's fp16 path is a constexpr, so its launches stay distinct and compile). Such twins (47
    # of 238, ~1 min of CI) fold into the bf16 launch (its 'where' names both).
    keys = {compile_key(r): r for r in launches}
    out = []
    for r in launches:
        twin = keys.get(compile_key(_as_bf16(r)))
        if twin is not None and twin is not r:
            twin["where"] += [w for w in r["where"] if w not in twin["where"]]
        else:
            out.append(r)
    return out


def _as_bf16(rec: dict) -> dict:
    """rec with its fp16 pointer arguments made bf16 (constexprs unchanged)."""
    args = {k: ["ptr", "bf16"] if v == ["ptr", "fp16"] else v for k, v in rec["args"].items()}
    return dict(rec, args=args)


@pytest.mark.parametrize("op", TRITON_OPS)
def test_triton_launches_recorded(op):
    runs, _ = _record(op)
    assert runs and all(n > 0 for *_, n in runs), (op, runs)


@pytest.fixture(scope="module")
def checker():
    c = Checker()
    yield c
    c.close()


@pytest.mark.parametrize("shard", range(SHARDS))
def test_triton_launches_compile_for_sm90(shard, checker):
    launches = _distinct_launches()[shard::SHARDS]
    assert launches, f"shard {shard}: no launches (SHARDS = {SHARDS} is too many)"
    failures = checker.compile(launches)
    assert not failures, "\n\n".join(
        f"{f['kernel']} num_warps={f['num_warps']} {f['args']}\n"
        f"launched by {', '.join(f['where'])}\n{f['error']}"
        for f in failures)
