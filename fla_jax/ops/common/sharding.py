"""Pallas kernels on batch/head-sharded inputs: one `jax.shard_map` around the kernel call.

A `pallas_call` is an opaque custom call to XLA's SPMD partitioner: left alone, a sharded
input is gathered and every device runs the whole problem. Every linear-attention op is
independent per batch row (per sequence) and per value head, so `run_op` wraps the chosen
Pallas implementation in a shard_map over the batch and head mesh axes (`shard_kernel`): each
device runs the kernels on its own rows and heads, and JAX differentiates the shard_map (the
kernels' custom_vjp runs per device, residuals stay per device). The reference and chunked
implementations are plain jnp and partition through XLA; they are not wrapped.

Which mesh axes, in this order:
1. `kernel_sharding(mesh, batch=..., heads=...)` (a context manager, read at trace time: trace
   the jitted function inside it);
2. else the sharding of q itself: a concrete array's NamedSharding (eager calls), or q's type
   under jit when the mesh axes are Explicit (`jax.sharding.AxisType.Explicit`); dimension 0
   of q gives the batch axes, dimension 2 the head axes;
3. else no wrap (one device, or a jit with Auto axes and no declaration: XLA then runs the
   kernel on gathered inputs -- right, not sharded).
Inside a shard_map that is manual over those axes already (context parallelism, a user's own
shard_map) the call runs as is.

Layouts come from the op's OpSpec shape symbols: B (and N without cu_seqlens) over the batch
axes; H, HV, HQ, HKV over the head axes; T, K, V, S whole. With cu_seqlens (B == 1) only the
heads are split. GQA stays right: contiguous head blocks of q/k (H) and v (HV) keep value head
hv with q/k head hv // (HV // H) on the same device.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

HEAD_SYMBOLS = ("H", "HV", "HQ", "HKV")


@dataclass(frozen=True)
class KernelSharding:
    """mesh: jax Mesh or AbstractMesh; batch / heads: tuples of its axis names."""

    mesh: object
    batch: tuple
    heads: tuple

    def size(self, axes: tuple) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def explicit(self) -> bool:
        """True when an axis in use is Explicit (sharding in types)."""
        types = dict(zip(self.mesh.axis_names, getattr(self.mesh, "axis_types", ())))
        return any(types.get(a) == AxisType.Explicit for a in self.batch + self.heads)


_ACTIVE: list = [None]


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@contextlib.contextmanager
def kernel_sharding(mesh=None, batch=(), heads=()):
    """Kernel calls traced inside run sharded over `batch` (mesh axes for B) and `heads` (mesh
    axes for H / HV). mesh: a jax.sharding.Mesh, or None for the mesh set by jax.set_mesh."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    batch, heads = _axes(batch), _axes(heads)
    names = tuple(getattr(mesh, "axis_names", ()))
    for what, axes in (("batch", batch), ("heads", heads)):
        for a in axes:
            if a not in names:
                raise ValueError(f"kernel_sharding: {what} axis {a!r} is not an axis of the "
                                 f"mesh; its axes are {names}")
    if set(batch) & set(heads):
        raise ValueError(f"kernel_sharding: batch={batch} and heads={heads} share an axis")
    previous, _ACTIVE[0] = _ACTIVE[0], KernelSharding(mesh, batch, heads)
    try:
        yield _ACTIVE[0]
    finally:
        _ACTIVE[0] = previous


def find_sharding(q):
    """The KernelSharding for a call whose first activation is q, or None (see module doc)."""
    if _ACTIVE[0] is not None:
        return _ACTIVE[0]
    if isinstance(q, jax.Array) and not isinstance(q, jax.core.Tracer):
        sharding = q.sharding
    else:
        sharding = jax.typeof(q).sharding
    if not isinstance(sharding, NamedSharding) or not sharding.mesh.axis_names:
        return None
    spec = tuple(sharding.spec) + (None,) * (q.ndim - len(sharding.spec))
    batch, heads = _axes(spec[0]), _axes(spec[2])
    if not (batch or heads):
        return None
    return KernelSharding(sharding.mesh, batch, heads)


def _partition(symbols: tuple, ks: KernelSharding, varlen: bool) -> PartitionSpec:
    def axes(s):
        if s == "B" or (s == "N" and not varlen):
            return ks.batch or None
        if s in HEAD_SYMBOLS:
            return ks.heads or None
        return None
    return PartitionSpec(*(axes(s) for s in symbols))


def _check_divisible(op: str, name: str, symbol: str, size: int, ks: KernelSharding,
                     axes: tuple):
    n = ks.size(axes)
    if axes and size % n:
        raise ValueError(f"{op}: {name} has {symbol} = {size}, not divisible by the {n} "
                         f"devices of mesh axes {axes} it is sharded over")


def shard_kernel(spec, fn, q, cu_seqlens, output_final_state: bool, kernel: bool = True):
    """fn (an implementation with run_op's calling convention) wrapped in a shard_map over
    the batch/head axes found for q; fn itself when none are found. kernel=False (reference,
    chunked, XLA attention): wrapped only when the axes are Explicit, where jnp code would need
    an out_sharding on every reshape of a sharded array; Auto axes partition it through XLA."""
    ks = find_sharding(q)
    if ks is None or not (kernel or ks.explicit):
        return fn
    manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    if manual & set(ks.batch + ks.heads):     # inside a shard_map over these axes already
        return fn
    varlen = cu_seqlens is not None
    if varlen:
        ks = KernelSharding(ks.mesh, (), ks.heads)
    if not (ks.batch or ks.heads):
        return fn
    shapes = {a.name: a.shape for a in spec.args}
    act_names = tuple(a.name for a in spec.activations)
    out_symbols = ("B", "T", "HV", "V")       # o: q's rows and time, v's heads and size
    state = next((a for a in spec.args if a.role == "state"), None)

    def wrapped(*acts, **kw):
        arrays = dict(zip(act_names, acts))
        for name in list(kw):
            if name in shapes and kw[name] is not None:
                arrays[name] = kw.pop(name)
        cu = kw.pop("cu_seqlens", None)
        for name, x in arrays.items():
            for symbol, size in zip(shapes[name], x.shape):
                if symbol == "B" or (symbol == "N" and not varlen):
                    _check_divisible(spec.name, name, symbol, size, ks, ks.batch)
                elif symbol in HEAD_SYMBOLS:
                    _check_divisible(spec.name, name, symbol, size, ks, ks.heads)
        in_specs = ({n: _partition(shapes[n], ks, varlen) for n in arrays},
                    None if cu is None else PartitionSpec())
        if ks.explicit:     # typed inputs must already carry the specs shard_map asks for
            arrays = {n: jax.reshard(x, NamedSharding(ks.mesh, in_specs[0][n]))
                      for n, x in arrays.items()}
        o_spec = _partition(out_symbols, ks, varlen)
        with_state = state is not None and output_final_state
        out_specs = (o_spec, _partition(state.shape, ks, varlen)) if with_state else o_spec

        def body(local, cu_local):
            local = dict(local)
            a = [local.pop(n) for n in act_names]
            out = fn(*a, **local, **kw, cu_seqlens=cu_local)
            if state is None:
                return out
            return out if with_state else out[0]

        # check_vma=False: a pallas_call's out_shape carries no varying-axes type. The body has
        # no collectives; the transpose psums the cotangents of inputs replicated over an axis.
        out = jax.shard_map(body, mesh=ks.mesh, in_specs=in_specs, out_specs=out_specs,
                            check_vma=False)(arrays, cu)
        if state is None or with_state:
            return out
        return out, None

    return wrapped
