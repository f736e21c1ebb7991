import sys, time, jax, jax.numpy as jnp, numpy as np
from fla_jax.ops.gated_delta_rule import mosaic_chunk as mc, mosaic_fwd_kernel as fk
from fla_jax.ops.gated_delta_rule.reference import gated_delta_rule_reference
import functools
from fla_jax.ops.gated_delta_rule import mosaic_tiles; mosaic_tiles.INTERPRET[0] = True
orig = fk.fused_forward
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
fk.fused_forward = functools.partial(orig, interpret=InterpretGPUParams())
mc.fused_forward = fk.fused_forward
B,T,H,HV,K,V = 1, 100, 1, 2, 64, 64
ks = jax.random.split(jax.random.PRNGKey(0), 6)
dt = jnp.bfloat16
q = jax.random.normal(ks[0], (B,T,H,K)).astype(dt)
k = jax.random.normal(ks[1], (B,T,H,K)).astype(dt)
v = jax.random.normal(ks[2], (B,T,HV,V)).astype(dt)
g = -jax.nn.softplus(jax.random.normal(ks[3], (B,T,HV)))
beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B,T,HV)))
h0 = jax.random.normal(ks[5], (B,HV,K,V))
t=time.time()
o, ht = mc.forward(q,k,v,g,beta,h0,None, scale=K**-0.5, l2=True)
print("ran", time.time()-t)
import inspect; print(inspect.signature(gated_delta_rule_reference))
def ref(q,k,v,g,beta,h0,cu=None):
    f = lambda x: None if x is None else x.astype(jnp.float32)
    return gated_delta_rule_reference(f(q),f(k),f(v),g=f(g),beta=f(beta),scale=K**-0.5,initial_state=h0,output_final_state=True,cu_seqlens=cu,use_qk_l2norm_in_kernel=True)
ro, rht = ref(q,k,v,g,beta,h0)
print("o err", float(jnp.max(jnp.abs(o.astype(jnp.float32)-ro))), float(jnp.max(jnp.abs(ro))))
print("ht err", float(jnp.max(jnp.abs(ht-rht))), float(jnp.max(jnp.abs(rht))))
