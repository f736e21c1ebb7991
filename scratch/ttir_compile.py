"""Compile a TTIR text file for sm_90 with the local triton (ptxas included), timing it."""
import sys, time, shutil, os
import triton
from triton.backends.compiler import GPUTarget
path = sys.argv[1]
nw = int(sys.argv[2]) if len(sys.argv) > 2 else 4
ns = int(sys.argv[3]) if len(sys.argv) > 3 else 1
dst = "/tmp/pf_k.ttir"
shutil.copy(path, dst)
t = time.time()
k = triton.compile(dst, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns})
el = time.time() - t
print(f"{os.path.basename(path)}: compiled in {el:.1f}s; ptx {len(k.asm['ptx'])/1e3:.0f} kB; "
      f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} shared {k.metadata.shared}")
