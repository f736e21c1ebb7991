import sys, time, jax, jax.numpy as jnp
from fla_jax.ops.gated_delta_rule.mosaic_fwd_kernel import fused_forward
from fla_jax.ops.common.mosaic import export_for_cuda
K = int(sys.argv[1]) if len(sys.argv) > 1 else 64
V = K; H, HV, R, N = 2, 4, 256, 2
dt = jnp.bfloat16
S = jax.ShapeDtypeStruct
args = [S((R, H, K), dt), S((R, H, K), dt), S((R, HV, V), dt), S((HV, R, 64), dt),
        S((HV, R), jnp.float32), S((HV, R), jnp.float32), S((HV, R), jnp.float32), S((N, 32), jnp.int32),
        S((N, HV, V, K), jnp.float32)]
f = lambda *a: fused_forward(*a, scale=0.1, group=2, residuals=True)
t = time.time()
txt = export_for_cuda(f, *args)
print("lowered", K, time.time() - t, len(txt))
