"""Run one fla_torch op on harness inputs; return outputs and gradients as float64 numpy."""
from __future__ import annotations

import contextlib
import importlib

import numpy as np
import torch

from .cases import ACTIVATION, Case, OpSpec, op_kwargs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}


def registry(spec: OpSpec) -> dict:
    mod = importlib.import_module(f"fla_torch.ops.{spec.family}.interface")
    if not spec.has_state:
        return mod.IMPLS
    return mod.CHUNK_IMPLS if spec.variant == "chunk" else mod.RECURRENT_IMPLS


def round_to(dtype: str, a: np.ndarray) -> np.ndarray:
    """The float64 values that `a` has once stored in `dtype` (via fp32, as both frameworks)."""
    t = torch.from_numpy(np.asarray(a, np.float32))
    return t.to(DTYPES[dtype]).to(torch.float64).numpy()


@contextlib.contextmanager
def poisoned_allocations():
    """Make torch.empty / empty_like / Tensor.new_empty return NaN-filled float tensors, so an
    output element a kernel forgets to write shows up as NaN."""
    orig_empty, orig_like, orig_new = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **kw: fill(orig_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: fill(orig_like(*a, **kw))
    torch.Tensor.new_empty = lambda self, *a, **kw: fill(orig_new(self, *a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = orig_empty, orig_like, orig_new


def run(spec: OpSpec, case: Case, impl: str, dtype: str, x: dict, device: str = "cpu",
        final_state: bool = True) -> dict:
    """x: float64 inputs already rounded to `dtype` (activations) / fp32 (gates, states).
    final_state=False: output_final_state=False, the op must return no final state."""
    import fla_torch.ops as ops

    dt = DTYPES[dtype]
    gdt = torch.float64 if dtype == "fp64" else torch.float32

    def leaf(a, d):
        return torch.tensor(a, dtype=d, device=device, requires_grad=True)

    args, leaves = {}, {}   # leaves: gradient name ('dq', 'dh0', ...) -> input tensor
    for a in spec.args:
        if a.key in x:
            d = dt if a.role == ACTIVATION else gdt
            if a.differentiable:
                args[a.name] = leaves["d" + a.key] = leaf(x[a.key], d)
            else:
                args[a.name] = torch.tensor(x[a.key], dtype=d, device=device)
    if spec.state_tuple:   # the state parts travel as one initial_state tuple (GSA)
        parts = tuple(args.pop(a.name, None) for a in spec.states)
        if any(p is not None for p in parts):
            args["initial_state"] = parts
    kw = op_kwargs(spec, case)
    if not final_state:
        kw["output_final_state"] = False
    if case.cu_seqlens is not None:
        kw["cu_seqlens"] = torch.tensor(case.cu_seqlens, dtype=torch.int32, device=device)

    fn = getattr(ops, spec.name)
    kernel = impl not in ("reference", "chunked")
    with poisoned_allocations() if kernel else contextlib.nullcontext():
        res = fn(**args, **kw, impl=impl)
        o, ht = res if spec.has_state else (res, None)   # softmax attention returns o only
        if not final_state and ht is not None:
            raise AssertionError(f"{spec.name}(impl={impl}): a final state although "
                                 f"output_final_state=False")
        finals = {} if ht is None else dict(zip(
            (a.final_key for a in spec.states), ht if spec.state_tuple else (ht,)))
        outs = [o] + list(finals.values())
        cots = [torch.tensor(x["do"], dtype=o.dtype, device=device)]
        cots += [torch.tensor(x["d" + n], dtype=t.dtype, device=device) for n, t in finals.items()]
        grads = torch.autograd.grad(outs, list(leaves.values()), cots, allow_unused=True)
    out = {"o": o, **finals}
    for name, gr in zip(leaves, grads):
        if gr is None:
            raise AssertionError(f"{spec.name}(impl={impl}): no gradient reached {name[1:]}")
        if gr.dtype != leaves[name].dtype:
            raise AssertionError(f"{spec.name}(impl={impl}): {name} has dtype {gr.dtype}; "
                                 f"expected its input's {leaves[name].dtype}")
        out[name] = gr
    if o.dtype != dt:
        raise AssertionError(f"{spec.name}(impl={impl}): o has dtype {o.dtype}; expected {dt}")
    for n, t in finals.items():
        if t.dtype != gdt:
            raise AssertionError(f"{spec.name}(impl={impl}): final state {n} has dtype {t.dtype}; "
                                 f"expected {gdt}")
    return {n: t.detach().to(torch.float64).cpu().numpy() for n, t in out.items()}
