import sys, time, jax, jax.numpy as jnp
from fla_jax.ops.common.mosaic import export_for_cuda
from fla_jax.ops.gated_delta_rule import chunk_gated_delta_rule, mosaic_chunk
mosaic_chunk.BACKWARD = "mosaic"
K = int(sys.argv[1]); varlen = len(sys.argv) > 2
S = jax.ShapeDtypeStruct
B, N, T, H, HV = (1, 3, 300, 2, 4) if varlen else (2, 2, 300, 2, 4)
dt = jnp.bfloat16
args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, HV, K), dt), S((B, T, HV), jnp.float32),
        S((B, T, HV), jnp.float32), S((N, HV, K, K), jnp.float32)] + ([S((N + 1,), jnp.int32)] if varlen else [])
def f(q, k, v, g, b, h0, cu=None):
    return chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True, impl="mosaic")
def fn(*a):
    (o, ht), vjp = jax.vjp(f, *a)
    return o, ht, vjp((jnp.ones_like(o), jnp.ones_like(ht)))
t = time.time(); txt = export_for_cuda(fn, *args)
print("lowered bwd", K, varlen, time.time() - t, txt.count("mosaic_gpu"), "triton" in txt)
