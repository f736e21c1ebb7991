"""Compile a TTIR text file for sm_90 with the local triton (ptxas included), timing it."""
import sys, time, shutil, os, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="pf_tc_")
import triton
from triton.backends.compiler import GPUTarget
path = sys.argv[1]
nw = int(sys.argv[2]) if len(sys.argv) > 2 else 4
ns = int(sys.argv[3]) if len(sys.argv) > 3 else 1
dst = "/tmp/pf_k.ttir"
shutil.copy(path, dst)
import resource
def cpu():
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + c.ru_utime + c.ru_stime
t, c0 = time.time(), cpu()
k = triton.compile(dst, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns})
el = time.time() - t
print(f"cpu {cpu() - c0:.1f}s")
print(f"{os.path.basename(path)}: compiled in {el:.1f}s; ptx {len(k.asm['ptx'])/1e3:.0f} kB; "
      f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} shared {k.metadata.shared}")

import subprocess, re
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")
open("/tmp/pf_k.ptx", "w").write(k.asm["ptx"])
r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "/tmp/pf_k.ptx", "-o", "/tmp/pf_k.cubin"],
                   capture_output=True, text=True)
print("ptxas:", " ".join(l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l))
