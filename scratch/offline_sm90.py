"""Offline sm_90 compile of the DPLR kernels (no GPU): registers, spills, shared memory."""
import re
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fla_torch.ops.common.engine import dplr_output, dplr_scores, dplr_state, dplr_tail, dplr_wy

TGT = GPUTarget("cuda", 90, 32)


def comp(name, fn, ptrs, scalars, consts, num_warps):
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in scalars:
            sig[a] = scalars[a]
        else:
            sig[a] = "*" + ptrs.get(a, "fp32")
    t = time.time()
    try:
        k = triton.compile(ASTSource(fn, sig, consts), target=TGT,
                           options=dict(num_warps=num_warps, num_stages=int(__import__("os").environ.get("STG", 1))))
        md = k.metadata
        import os
        import subprocess
        import tempfile
        f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False)
        f.write(k.asm["cubin"])
        f.close()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", res, re.S)
        print(f"{name}: {m.group(0) if m else res[-300:]} shared(meta)={md.shared} "
              f"({time.time() - t:.1f}s)", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)


K = V = int(sys.argv[1]) if len(sys.argv) > 1 else 64
dt = sys.argv[2] if len(sys.argv) > 2 else "bf16"
P = __import__("os").environ.get("PREC", "tf32x3")
which = sys.argv[3:] or ["sf", "sb", "wy", "of", "ob", "st", "sbk", "tail"]
if "sf" in which:
    comp("scores_fwd", dplr_scores._dplr_scores_fwd,
         dict(r=dt, k=dt, tok="i64", gbuf="fp64"), {},
         dict(H=16, K=K, BT=64, BC=16, BK=int(__import__("os").environ.get("SBK", 32)), PREC=P), int(__import__("os").environ.get("SW", 8)))
if "sb" in which:
    from fla_torch.ops.common.engine import dplr_scores_bwd
    comp("scores_bwd_row", dplr_scores_bwd._dplr_scores_bwd_row,
         dict(r=dt, k=dt, tok="i64", gbuf="fp64", dr=dt), {},
         dict(H=16, K=K, BT=64, BC=16, BK=min(K, 32), PREC=P), 8)
    comp("scores_bwd_col", dplr_scores_bwd._dplr_scores_bwd_col,
         dict(r=dt, k=dt, tok="i64", gbuf="fp64", dk=dt), {},
         dict(H=16, K=K, BT=64, BC=16, BK=min(K, 32), PREC=P), 8)
if "wy" in which:
    comp("wy", dplr_wy._dplr_wy_fwd, dict(tok="i64", v=dt), {}, dict(H=16, K=K, V=V, BT=64, BK=min(K, 64),
                                                BV=min(V, 64), PREC=P), 4)
if "of" in which:
    comp("out_fwd", dplr_output._dplr_out_fwd, dict(tok="i64", o=dt, v=dt), dict(scale="fp32"),
         dict(H=16, K=K, V=V, BT=64, BK=min(K, 64), BV=min(V, 64), PREC=P),
         int(__import__("os").environ.get("FW", 8)))
if "ob" in which:
    comp("out_bwd", dplr_output._dplr_out_bwd, dict(tok="i64", do=dt, v=dt), dict(scale="fp32"),
         dict(H=16, K=K, V=V, BT=64, BK=min(K, 64), BV=min(V, 64), PREC=P),
         int(__import__("os").environ.get("OW", 8)))
if "st" in which:
    BK, BV = dplr_state._tiles(K, V)
    comp("state_fwd", dplr_state._dplr_state_fwd, dict(first="i32", count="i32", tok="i64", v=dt), {},
         dict(H=16, K=K, V=V, BT=64, BK=BK, BV=BV, USE_H0=True, STORE_HT=True, PREC=P), 4)
    comp("state_bwd", dplr_state._dplr_state_bwd, dict(first="i32", count="i32"), {},
         dict(H=16, K=K, V=V, BT=64, BK=BK, BV=BV, USE_DHT=True, STORE_DH0=True, PREC=P), 4)
if "tail" in which:
    comp("tail", dplr_tail._dplr_tail_bwd, dict(tok="i64", dv=dt, v=dt), {},
         dict(H=16, K=K, V=V, BT=64, BK=min(K, 64), BV=min(V, 64), PREC=P),
         int(__import__("os").environ.get("TW", 8)))
