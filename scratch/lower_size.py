"""Lower Pallas ops for cuda on CPU and report module size and per-kernel IR sizes."""
import re, sys, time
import jax, jax.numpy as jnp
from fla_jax.ops.common.dispatch import compiled_for_gpu
import fla_jax.ops as jops

from jax._src.pallas.triton import lowering as _tl
KERNELS = []
_orig = _tl.lower_jaxpr_to_triton_module
def _wrap(jaxpr, grid_mapping, *a, **k):
    r = _orig(jaxpr, grid_mapping, *a, **k)
    asm = r.module.operation.get_asm(large_elements_limit=16)
    KERNELS.append((str(jaxpr.debug_info.func_name), len(asm), asm.count("\n"), asm, len(str(jaxpr))))
    return r
_tl.lower_jaxpr_to_triton_module = _wrap

def structs(op, B, T, H, K, V, dt):
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    if op.endswith("kda"):
        return dict(q=S((B,T,H,K),dt), k=S((B,T,H,K),dt), v=S((B,T,H,V),dt), g=S((B,T,H,K),f32),
                    beta=S((B,T,H),f32), initial_state=S((B,H,K,V),f32))
    return dict(r=S((B,T,H,K),dt), w=S((B,T,H,K),f32), k=S((B,T,H,K),dt), v=S((B,T,H,V),dt),
                a=S((B,T,H,K),f32), b=S((B,T,H,K),f32), initial_state=S((B,H,K,V),f32))

def make_loss(op):
    fn = getattr(jops, op)
    def loss(x):
        x = dict(x)
        o, ht = fn(**x, output_final_state=True, impl="pallas")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)
    return loss

def measure(op, B=2, T=300, H=4, K=64, V=64, dt=jnp.bfloat16, grad=True):
    x = structs(op, B, T, H, K, V, dt)
    f = jax.value_and_grad(make_loss(op)) if grad else make_loss(op)
    t = time.time()
    with compiled_for_gpu():
        low = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
    txt = low.as_text()
    el = time.time() - t
    calls = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*', txt)
    print(f"{op} grad={grad} {jnp.dtype(dt).name} K={K}: lower {el:.1f}s, module {len(txt)/1e6:.2f} MB, "
          f"{len(calls)} triton calls, {txt.count(chr(10))} lines")
    for name, n, lines, asm, nj in KERNELS:
        print(f"   {name:30s} TTIR {n/1e3:.0f} kB, {lines} lines; jaxpr {nj/1e3:.0f} kB")
        open(f"/tmp/pf_ttir_{op}_{name}.mlir", "w").write(asm)
    KERNELS.clear()
    return low, txt

if __name__ == "__main__":
    op = sys.argv[1]; K = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[sys.argv[3] if len(sys.argv) > 3 else "bf16"]
    low, txt = measure(op, K=K, V=K, dt=dt)
    open(f"/tmp/pf_{op}_{K}.mlir", "w").write(txt)
