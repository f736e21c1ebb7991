"""Registers, spills and shared memory of each Pallas chunk_gla kernel on sm_90a, without a GPU.

    PYTHONPATH=. python benchmarks/offline_regs.py bf16 "{'output_fwd': L.Launch(16, 128, 8, 1)}" [kernels]

Lowers chunk_gla_pallas fwd+bwd for cuda on CPU (compiled_for_gpu), takes each kernel's Triton
IR from the lowered module (MLIR bytecode, printed as text with jaxlib's Triton dialect),
compiles it with the pip Triton for sm_90a and runs `ptxas -v` (triton's ptxas-blackwell, which
reads its PTX version). The pip Triton is not the H100's (jaxlib's), so the numbers guide,
they do not replace, a GPU timing. Files go to $REGS_DIR (default scratch/kk).
"""
import os, re, sys, subprocess, json
import jax, jax.numpy as jnp
from jax._src.lib.mlir import ir as mir
from jaxlib.triton import dialect as ttd
from fla_jax.ops.common.dispatch import compiled_for_gpu
from fla_jax.ops.gla.pallas_chunk import chunk_gla_pallas
from fla_jax.ops.common.engine import launch as L

def lower(dtype, overrides):
    L.OVERRIDES.clear(); L.OVERRIDES.update(overrides)
    S = jax.ShapeDtypeStruct
    B, T, H, K, V = 1, 256, 2, 128, 128
    x = dict(q=S((B,T,H,K),dtype), k=S((B,T,H,K),dtype), v=S((B,T,H,V),dtype), g=S((B,T,H,K),jnp.float32))
    def loss(x):
        o, _ = chunk_gla_pallas(x["q"], x["k"], x["v"], g=x["g"], scale=K**-0.5)
        return jnp.sum(o.astype(jnp.float32))
    with compiled_for_gpu():
        return jax.jit(jax.value_and_grad(loss)).trace(x).lower(lowering_platforms=("cuda",)).as_text()

def unescape(s):
    b = bytearray(); j = 0
    while j < len(s):
        c = s[j]
        if c == '\\':
            h = s[j+1:j+3]
            if len(h) == 2 and all(ch in '0123456789ABCDEFabcdef' for ch in h):
                b.append(int(h, 16)); j += 3; continue
            b.append(ord(s[j+1])); j += 2; continue
        b.append(ord(c)); j += 1
    return bytes(b)

def kernels(text):
    for m in re.finditer(r'ir = "((?:[^"\\]|\\.)*)", name = "([a-z_]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text):
        yield m.group(2), unescape(m.group(1)), int(m.group(3)), int(m.group(4))

def compile_one(name, bc, stages, warps, tag):
    ctx = mir.Context(); ttd.register_dialect(ctx)
    with ctx:
        txt = str(mir.Module.parse(bc))
    base = os.environ.get("REGS_DIR", "scratch/kk") + f"/{tag}_{name}"
    os.makedirs(os.environ.get("REGS_DIR", "scratch/kk"), exist_ok=True)
    open(base + ".ttir", "w").write(txt)
    r = subprocess.run([sys.executable, "-c", f"""
import os; os.environ.pop('TRITON_INTERPRET', None); os.environ['TRITON_DEFAULT_FP_FUSION']='1'
import triton
from triton.backends.compiler import GPUTarget
k = triton.compile('{base}.ttir', target=GPUTarget('cuda', 90, 32), options=dict(num_warps={warps}, num_stages={stages}))
open('{base}.ptx','w').write(k.asm['ptx']); print('SHARED', k.metadata.shared)
"""], capture_output=True, text=True)
    if r.returncode:
        return f"{name}: triton compile failed: {r.stderr[-800:]}"
    shared = re.search(r"SHARED (\d+)", r.stdout).group(1)
    px = os.path.dirname(__import__('importlib').util.find_spec('triton').origin) + "/backends/nvidia/bin/ptxas-blackwell"
    p = subprocess.run([px, "-arch=sm_90a", "-v", base + ".ptx", "-o", base + ".cubin"], capture_output=True, text=True)
    info = p.stderr
    regs = re.search(r"Used (\d+) registers", info); sp = re.search(r"(\d+) bytes spill stores", info)
    return f"{name:20s} warps={warps} stages={stages} regs={regs.group(1) if regs else '?'} spill_st={sp.group(1) if sp else '?'} smem={shared}"

if __name__ == "__main__":
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[sys.argv[1]]
    ov = eval(sys.argv[2]) if len(sys.argv) > 2 else {}
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    text = lower(dt, ov)
    for name, bc, st, w in kernels(text):
        if only and name not in only: continue
        print(compile_one(name, bc, st, w, sys.argv[1]), flush=True)
