"""Softmax attention timings for benchmarks/run.py (`--ops attention`): our op in each
framework against the engine it is built on, measured in the same call.

    torch: fla_torch.ops.attention (impl='auto' -> SDPA)  vs  F.scaled_dot_product_attention
           restricted to the flash backend
    jax:   fla_jax.ops.attention (impl='auto' -> cuDNN where it takes the call) vs
           jax.nn.dot_product_attention(implementation='cudnn')
Causal, [B, T, H, D] inputs drawn once (float32 numpy, standard normal) and cast per dtype.
The bar of issue 13: fwd+bwd of ours within 1.1x of the engine's.
"""
from __future__ import annotations

ATTN_SHAPES = {"B4T4096": dict(B=4, T=4096, H=16, D=128)}
ATTN_PATHS = ("attn-torch", "sdpa-flash", "attn-jax", "jax-cudnn")
BASELINE = {"attn-torch": "sdpa-flash", "attn-jax": "jax-cudnn"}


def make_numpy(s, seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    shape = (s["B"], s["T"], s["H"], s["D"])
    return {n: rng.standard_normal(shape, np.float32) for n in ("q", "k", "v", "do")}


def torch_case(path, x, dtype, device="cuda"):
    """(fwd, fwd+bwd, params) for 'attn-torch' or 'sdpa-flash'."""
    import contextlib

    import torch
    import torch.nn.functional as F
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    q, k, v = (torch.tensor(x[n], device=device).to(dt).requires_grad_() for n in "qkv")
    do = torch.tensor(x["do"], device=device).to(dt)
    if path == "attn-torch":
        from fla_torch.ops import attention
        call, ctx = (lambda: attention(q, k, v, causal=True)), contextlib.nullcontext
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        dot = do.transpose(1, 2)

        def call():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        ctx = (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)) if device == "cuda" \
            else contextlib.nullcontext
        do = dot

    def fwd():
        with torch.no_grad(), ctx():
            return call()

    def fwdbwd():
        with ctx():
            call().backward(do)
    return fwd, fwdbwd, [q, k, v]


def jax_case(path, x, dtype, implementation="cudnn"):
    """(fwd, fwd+bwd) for 'attn-jax' or 'jax-cudnn' (implementation='xla' for a CPU check)."""
    import jax
    import jax.numpy as jnp
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[dtype]
    q, k, v, do = (jnp.asarray(x[n]).astype(dt) for n in ("q", "k", "v", "do"))
    if path == "attn-jax":
        from fla_jax.ops import attention

        def f(q, k, v):
            return attention(q, k, v, causal=True)
    else:
        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                implementation=implementation)
    fwd = jax.jit(f)
    fwdbwd = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](do))
    return (lambda: fwd(q, k, v)), (lambda: fwdbwd(q, k, v))


def run(dtypes, shapes, time_torch, time_jax, rows):
    """Append one row per (shape, dtype, path) to rows (errors reported, not hidden)."""
    import torch
    for shape in shapes:
        x = make_numpy(ATTN_SHAPES[shape])
        for dtype in dtypes:
            for path in ATTN_PATHS:
                try:
                    if path in ("attn-torch", "sdpa-flash"):
                        fwd, fb, params = torch_case(path, x, dtype)
                        f_ms, f_first = time_torch(fwd, params)
                        b_ms, b_first = time_torch(fb, params)
                    else:
                        fwd, fb = jax_case(path, x, dtype)
                        f_ms, f_first = time_jax(fwd)
                        b_ms, b_first = time_jax(fb)
                    rows.append(dict(shape=shape, op="attention", dtype=dtype, path=path,
                                     fwd_ms=f_ms, fwdbwd_ms=b_ms, first_s=f_first + b_first))
                    print(f"{shape} attention {dtype} {path}: fwd {f_ms:.3f} ms, fwd+bwd "
                          f"{b_ms:.3f} ms", flush=True)
                except Exception as e:   # a path that fails is reported, not hidden
                    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    rows.append(dict(shape=shape, op="attention", dtype=dtype, path=path,
                                     error=msg))
                    print(f"{shape} attention {dtype} {path}: FAILED {msg}", flush=True)
                finally:
                    torch.cuda.empty_cache()


def ratio_lines(rows):
    """Ours / engine per framework, shape and dtype (fwd and fwd+bwd)."""
    ok = {(r["shape"], r["dtype"], r["path"]): r for r in rows
          if r.get("op") == "attention" and "error" not in r}
    lines = []
    for (shape, dtype, path), r in ok.items():
        b = ok.get((shape, dtype, BASELINE.get(path)))
        if b:
            lines.append(f"{shape} attention {dtype} {path} / {BASELINE[path]}: fwd "
                         f"{r['fwd_ms'] / b['fwd_ms']:.2f}x, fwd+bwd "
                         f"{r['fwdbwd_ms'] / b['fwdbwd_ms']:.2f}x (bar: <= 1.10x)")
    return lines


def dry_run(dtypes):
    """CPU check of the four calls at a tiny shape (jax baseline with implementation='xla')."""
    x = make_numpy(dict(B=1, T=40, H=2, D=16))
    for dtype in dtypes:
        for path in ATTN_PATHS:
            if path in ("attn-torch", "sdpa-flash"):
                fwd, fb, _ = torch_case(path, x, dtype, device="cpu")
            else:
                fwd, fb = jax_case(path, x, dtype, implementation="xla")
            fwd(), fb()
        print(f"dry run attention {dtype}: {', '.join(ATTN_PATHS)} ok (jax-cudnn as xla on CPU)",
              flush=True)
