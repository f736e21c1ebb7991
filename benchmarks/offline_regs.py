"""Registers and spills of the heaviest Triton kernels on sm_90, without a GPU.

Compiles each kernel with the local Triton for an H100 target (ptxas ships with Triton) at the
launch parameters the op wrappers use now (their LAUNCH dicts), and prints what the cubin
reserves per thread: registers, stack (spilled registers), shared memory. A kernel at 255
registers with a stack spills, and one program then holds a whole SM's register file: the
KDA / RWKV-7 score kernels ran 2-3x slower than FLA's for that reason (RESULTS.md, run 7).
The local Triton may be newer than the GPU machine's, so numbers are indicative; the GPU
timing decides.

    PYTHONPATH=. python benchmarks/offline_regs.py                 # every preset
    PYTHONPATH=. python benchmarks/offline_regs.py delta_scores --warps 2 4 --bk 16 32
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

BF16, I32, I64 = "bf16", "i32", "i64"
SCALARS = {"T": I32, "N": I32, "n_steps": I32, "scale": "fp32"}


@dataclass
class Preset:
    """One kernel at the op wrapper's launch (its key block is the constexpr BK): pointer dtypes
    not listed are fp32."""
    kernel: object
    ptrs: dict
    consts: dict
    warps: int
    stages: int = 1
    maxnreg: int | None = None


def presets() -> dict:
    import triton.language as tl

    import torch

    from fla_torch.ops.common.engine import (cumsum_scores, delta_bwd, delta_scores, dplr_scores,
                                             dplr_scores_bwd, gates, launch)
    cs = launch.launch_for("cumsum_scores", 128, 128, torch.bfloat16)
    seq = dict(cu_seqlens=I32)
    ds, dp, dpb, db = (delta_scores.LAUNCH, dplr_scores.LAUNCH, dplr_scores_bwd.LAUNCH,
                       delta_bwd.LAUNCH)
    dplr_ptrs = dict(r=BF16, k=BF16, tok=I64, gbuf="fp64")
    return {
        # KDA (K = V = 128): chunk_kda's forward scores, its output backward, the gate cumsum
        "delta_scores": Preset(
            delta_scores._delta_scores_kernel,
            dict(q=BF16, k=BF16, qg=BF16, kb=BF16, qgr=BF16, **seq),
            dict(H=16, K=128, BT=64, BC=16, BK=ds["BK"], REL=False, IS_VARLEN=False,
                 PREC="tf32"), ds["num_warps"], 2),
        "delta_output_bwd": Preset(
            delta_bwd._delta_output_bwd_kernel,
            dict(q=BF16, k=BF16, vn=BF16, do=BF16, h=BF16, dh=BF16, dq=BF16, dk=BF16, **seq),
            dict(H=16, K=128, V=128, BT=64, BC=16, BK=db["BK"], BV=db["BV"], REL=False,
                 SCRATCH=db["SCRATCH"], IS_VARLEN=False, PREC="tf32"), db["num_warps"], 2),
        # GLA (K = 128): the key-gate forward front stage (gate cumsum + intra-chunk scores)
        "cumsum_scores": Preset(
            cumsum_scores._cumsum_scores_kernel, dict(q=BF16, k=BF16, A=BF16, qg=BF16, kg=BF16,
                                                      **seq),
            dict(H=16, K=128, BT=64, BC=16, BK=cs.BK, STORE_CUM=True, IS_VARLEN=False,
                 PREC="tf32"), cs.num_warps, cs.num_stages),
        "cumsum_key": Preset(
            gates._cumsum_kernel, dict(k=BF16, kg=BF16, **seq),
            dict(H=16, K=128, GK=128, BT=64, BK=32, GATE=2, IS_VARLEN=False), 4),
        # RWKV-7 (K = V = 64): the DPLR scores forward (two kernels) and backward (three)
        "dplr_vectors_fwd": Preset(dplr_scores._dplr_vectors_fwd, dplr_ptrs,
                                   dict(H=16, K=64, BT=64, BK=dp["BK_vec"]), 4),
        "dplr_scores_fwd": Preset(
            dplr_scores._dplr_scores_fwd, dplr_ptrs,
            dict(H=16, K=64, BT=64, BC=16, BK=dp["BK"], PREC="tf32x3",
                 DT=tl.bfloat16), dp["num_warps"],
            maxnreg=dp["maxnreg"]),
        "dplr_scores_bwd_row": Preset(
            dplr_scores_bwd._dplr_scores_bwd_row, dict(dplr_ptrs, dr=BF16),
            dict(H=16, K=64, BT=64, BC=16, BK=dpb["BK"], PREC="tf32x3",
                 DT=tl.bfloat16), dpb["num_warps"],
            maxnreg=dpb["maxnreg_row"]),
        "dplr_scores_bwd_col": Preset(
            dplr_scores_bwd._dplr_scores_bwd_col, dict(dplr_ptrs, dk=BF16),
            dict(H=16, K=64, BT=64, BC=16, BK=dpb["BK"], PREC="tf32x3",
                 DT=tl.bfloat16), dpb["num_warps"],
            maxnreg=dpb["maxnreg_col"]),
        "dplr_scores_bwd_dw": Preset(
            dplr_scores_bwd._dplr_scores_bwd_dw, dict(dplr_ptrs, dw=BF16),
            dict(H=16, K=64, BT=64, BK=dpb["BK_dw"]), 4),
    }


def compiled_resources(compiled) -> dict:
    """{'regs', 'stack', 'shared'} (bytes for stack and shared) of a kernel compiled for sm_90,
    read from its cubin by cuobjdump -res-usage (shared: static + the launch's dynamic)."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", out, re.S)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no resource line:\n{out[-500:]}")
    return {"regs": int(m.group(1)), "stack": int(m.group(2)),
            "shared": int(m.group(3)) + int(compiled.metadata.shared)}


def resources(preset: Preset, warps: int | None = None, bk: int | None = None) -> dict:
    """{'regs', 'stack', 'shared'} of the preset's kernel compiled for sm_90 (bytes for stack
    and shared), optionally at other warps / key block."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("offline_regs compiles for sm_90: unset TRITON_INTERPRET (the "
                           "kernels are interpreted under it and cannot be compiled)")
    consts = dict(preset.consts)
    if bk is not None:
        consts["BK"] = bk
    fn = preset.kernel
    sig = {a: "constexpr" if a in consts else SCALARS.get(a) or "*" + preset.ptrs.get(a, "fp32")
           for a in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps or preset.warps,
                                           num_stages=preset.stages, maxnreg=preset.maxnreg))
    return compiled_resources(compiled)


def main(argv=None):
    table = presets()
    p = argparse.ArgumentParser()
    p.add_argument("kernels", nargs="*", help=f"any of {sorted(table)} (default: all)")
    p.add_argument("--warps", nargs="+", type=int, default=[None])
    p.add_argument("--bk", nargs="+", type=int, default=[None])
    args = p.parse_args(argv)
    unknown = sorted(set(args.kernels) - set(table))
    if unknown:
        p.error(f"kernels {unknown}: expected any of {sorted(table)}")
    rows = []
    for name in args.kernels or sorted(table):
        for warps in args.warps:
            for bk in args.bk:
                r = resources(table[name], warps, bk)
                w = warps or table[name].warps
                b = bk or table[name].consts["BK"]
                flag = "  <- spills" if r["stack"] else ""
                print(f"{name:22s} warps {w} BK {b:3d}: {r['regs']:3d} registers, stack "
                      f"{r['stack']:5d} B, shared {r['shared']:6d} B{flag}", flush=True)
                rows.append(dict(kernel=name, warps=w, BK=b, **r))
    return rows


if __name__ == "__main__":
    main()
