"""The parity CLI explains itself: --help, the legend and tolerance rows, fixed columns, and a
one-line refusal (exit 2, no traceback) for --device cuda without a GPU."""
from __future__ import annotations

import os

import pytest

from parity_tests.__main__ import main
from parity_tests.cases import CPU_CASES, GPU_CASES, OPS, TENSORS, TOLERANCE
from parity_tests.harness import Row
from parity_tests.report import group_lines, header, tolerance_lines


def test_help_lists_ops_cases_and_metric(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in list(OPS) + [c.name for c in CPU_CASES + GPU_CASES]:
        assert name in out, name
    assert "RMS(a - b) / RMS(ref)" in out and "TOLERANCE" in out


def test_rows_keep_their_columns():
    rows = [Row("fused_recurrent_gated_delta_rule", "gpu_strong_uniform", "bf16",
                "jax:reference vs torch:reference", "o", 1e-3, 2e-2),
            Row("chunk_gla", "basic", "fp32", "torch:chunked vs fp64", "dq", 3e-5, 1e-5)]
    lines = group_lines(rows)
    col = header().index("result")
    assert [ln.index(" pass") + 1 if "pass" in ln else ln.index(" FAIL") + 1 for ln in lines] \
        == [col, col]
    assert lines[1].endswith("FAIL") and "3.0e-05!" in lines[1]
    assert header().index("compared") == lines[0].index("jax:reference")


def test_tolerance_rows_print_the_table():
    bf16, = tolerance_lines(["bf16"])
    cells = bf16.split()[-len(TENSORS):]
    assert cells == [f"{TOLERANCE['bf16'][t]:.1e}" for t in TENSORS]
    assert "2.5e-02" in bf16 and "3e-02" not in bf16


def _keep_env(monkeypatch):
    """main() sets PARITY_DEVICE (and CPU defaults); put them back after the test."""
    for name in ("PARITY_DEVICE", "TRITON_INTERPRET", "JAX_PLATFORMS", "XLA_FLAGS"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


def test_report_legend_and_total(capsys, monkeypatch):
    _keep_env(monkeypatch)
    assert main(["--ops", "fused_recurrent_simple_gla", "--dtypes", "fp32",
                 "--cases", "basic"]) == 0
    out = capsys.readouterr().out
    for words in ("RMS(a - b) / RMS(ref)", "float64 oracle", "'comparisons'", "Environment: "
                  "device cpu", "torch ", "jax ", "tolerance"):
        assert words in out, words
    rows = [ln for ln in out.splitlines() if ln.startswith("fused_recurrent_simple_gla")]
    cells = sum(len([c for c in ln.split()[6:-1] if c != "-"]) for ln in rows)
    assert len(rows) == 3 and f"{cells} comparisons, 0 failed" in out


def test_cuda_without_gpu_is_one_line(capsys, monkeypatch):
    import torch
    _keep_env(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--device", "cuda", "--frameworks", "torch"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA GPU" in err and "--device cpu" in err


def test_cuda_without_gpu_jax(capsys, monkeypatch):
    import jax
    _keep_env(monkeypatch)

    def no_gpu(*a):
        if a and a[0] == "gpu":
            raise RuntimeError("Unknown backend gpu")
        return []
    monkeypatch.setattr(jax, "devices", no_gpu)
    assert main(["--device", "cuda", "--frameworks", "jax"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "jax sees no GPU" in err


def test_mosaic_cells_off_hopper_are_listed_not_run(capsys, monkeypatch):
    """--impls mosaic off a Hopper GPU: each cell of an op with Mosaic kernels is printed as
    skipped with the reason, an op without them is 'not registered', nothing is compared."""
    _keep_env(monkeypatch)
    assert main(["--impls", "mosaic", "--ops", "chunk_gated_delta_rule", "chunk_kda",
                 "--dtypes", "bf16", "--cases", "basic"]) == 0
    out = capsys.readouterr().out
    assert "skipped chunk_gated_delta_rule basic bf16 jax:mosaic: no Hopper GPU" in out
    assert "0 comparisons, 0 failed" in out and "chunk_kda mosaic (jax)" in out
    assert "1 cells an implementation cannot take" in out


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_delta_rule", "chunk_simple_gla",
                                "chunk_gla"])
def test_mosaic_reasons_per_case(op, monkeypatch):
    """On a (pretended) Hopper GPU the CLI asks the family's mosaic_unsupported_reason with
    the case's shapes: fp32 and K=100 are refused with the reason, the 4k / GQA / varlen
    cases in bf16 / fp16 are taken."""
    from fla_jax.ops.common.mosaic import lowering
    from parity_tests import jax_runner
    from parity_tests.cases import CASES
    monkeypatch.setattr(lowering, "on_hopper", lambda: True)
    spec = OPS[op]
    assert "float16" in jax_runner.unsupported(spec, CASES["gpu_4k"], "mosaic", "fp32")
    assert "K=100" in jax_runner.unsupported(spec, CASES["gpu_d100"], "mosaic", "bf16")
    for name in ("gpu_4k", "gpu_varlen") + (("gpu_gqa",) if spec.grouped_heads else ()):
        for dtype in ("bf16", "fp16"):
            assert jax_runner.unsupported(spec, CASES[name], "mosaic", dtype) is None, name
    assert jax_runner.unsupported(spec, CASES["gpu_4k"], "pallas", "fp32") is None
