import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, '.')
from fla_jax.ops.common.mosaic.tiles import gpu_interpret
from fla_jax.ops.gated_delta_rule import mosaic_chunk
from parity_tests.test_pallas_delta import _compare, _inputs
mosaic_chunk.BACKWARD = "mosaic"
import os
from fla_jax.ops.gated_delta_rule import mosaic_bwd
mosaic_bwd.LOCAL_MATMUL = os.environ.get("LOCAL_MATMUL", "fp32")
case = sys.argv[1] if len(sys.argv) > 1 else "base"
gated = True
if case == "base":
    B,T,H,HV,K,V,cu,h0,l2 = 1, 100, 1, 1, 64, 64, None, True, False
elif case == "gqa":
    B,T,H,HV,K,V,cu,h0,l2 = 2, 100, 1, 2, 64, 64, None, True, True
elif case == "varlen":
    B,T,H,HV,K,V,cu,h0,l2 = 1, 140, 1, 1, 64, 128, [0, 7, 7, 100, 140], True, False
N = B if cu is None else len(cu) - 1
x = _inputs(7, B, T, H, HV, K, V, N, gated, (0.05, 0.95), -3, h0)
if not l2:
    x["k"] = x["k"] / np.sqrt(K)
with gpu_interpret():
    _compare(mosaic_chunk.chunk_gated_delta_rule_mosaic, x, "bf16", f"bwd {case}", gated=gated,
             scale=K ** -0.5, l2norm=l2, cu=cu, h0=h0)
print("PASS", case)
