"""Every Pallas kernel, forward and backward, lowered for the GPU (Triton lowering) on CPU.

Interpreted runs (the rest of the suite) accept any jnp primitive; the Triton lowering does
not (`x[0]` in a kernel lowers to `slice`, which it lacks: found only on the H100). Here each
op's jitted value-and-grad is traced and lowered with lowering_platforms=("cuda",) under
`compiled_for_gpu()`, so such a kernel fails in CI. Nothing runs; no GPU is needed.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import pytest

from fla_jax.ops.common.dispatch import compiled_for_gpu

# op -> the family's interface module and registry, whose "pallas" entry the dispatcher runs
OPS = {f"{kind}_{family}": (f"fla_jax.ops.{family}.interface", registry)
       for family in ("simple_gla", "gla", "delta_rule", "gated_delta_rule")
       for kind, registry in (("chunk", "CHUNK_IMPLS"), ("fused_recurrent", "RECURRENT_IMPLS"))}
OPS.update({f"{kind}_{family}": (f"fla_jax.ops.{family}.interface", registry)
            for family in ("kda", "rwkv7")
            for kind, registry in (("chunk", "CHUNK_IMPLS"), ("fused_recurrent", "RECURRENT_IMPLS"))})
DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def _fn(op):
    interface, registry = OPS[op]
    module, _, name = getattr(importlib.import_module(interface), registry)["pallas"].partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("op", list(OPS))
def test_lowers_for_gpu(op, dtype, varlen):
    B, T, H, K, V = (1, 200, 2, 128, 128) if varlen else (2, 128, 2, 128, 128)
    N = 3 if varlen else B
    dt, f32 = DT[dtype], jnp.float32
    S = jax.ShapeDtypeStruct
    x = {"q": S((B, T, H, K), dt), "k": S((B, T, H, K), dt), "v": S((B, T, H, V), dt),
         "h0": S((N, H, K, V), f32)}
    if op.endswith("_gla") and "simple" not in op or op.endswith("_kda"):
        x["g"] = S((B, T, H, K), f32)
    elif op.endswith("_rwkv7"):
        x.update({n: S((B, T, H, K), f32) for n in ("w", "a", "b")})
    elif "simple_gla" in op or "gated" in op:
        x["g"] = S((B, T, H), f32)
    if "delta" in op or op.endswith("_kda"):
        x["beta"] = S((B, T, H), f32)
    cu = jnp.asarray([0, 50, 120, 200], jnp.int32) if varlen else None
    fn = _fn(op)

    def loss(x):
        kw = {n: x[n] for n in ("g", "beta", "w", "a", "b") if n in x}
        if "delta" in op or op.endswith("_kda"):
            kw["use_qk_l2norm_in_kernel"] = True
        o, ht = fn(x["q"], x["k"], x["v"], scale=K ** -0.5, initial_state=x["h0"],
                   output_final_state=True, cu_seqlens=cu, **kw)
        return jnp.sum(o.astype(f32)) + jnp.sum(ht)

    with compiled_for_gpu():
        lowered = jax.jit(jax.value_and_grad(loss)).trace(x).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "triton" in text.lower(), "no Triton kernel call in the lowered module"
