"""One validation routine for every op, in both frameworks.

Each framework describes its arguments as `TensorInfo(name, shape, dtype)` (dtype as a
canonical name, see names.py, or the framework's own spelling for non-float types) and
calls `validate_op`. Errors name the argument, what was given and what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .names import FLOAT_NAMES, INT_NAMES, pretty


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple
    dtype: str


@dataclass(frozen=True)
class Dims:
    """Sizes of one call. N = number of sequences (len(cu_seqlens)-1, or B)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    dtype: str


def _shape(t: TensorInfo) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_rank(op: str, t: TensorInfo, rank: int, layout: str) -> None:
    if len(t.shape) != rank:
        raise ValueError(f"{op}: {t.name} has shape {_shape(t)} (rank {len(t.shape)}); "
                         f"expected rank {rank}, {layout}")


def _check_float(op: str, t: TensorInfo, role: str) -> None:
    if t.dtype not in FLOAT_NAMES:
        raise TypeError(f"{op}: {t.name} has dtype {pretty(t.dtype)}; expected a floating "
                        f"dtype ({role} are converted to float32 inside the op)")


def _check_activation_dtypes(op: str, impl: str, allowed: Sequence[str],
                             tensors: Sequence[TensorInfo]) -> str:
    dtypes = [t.dtype for t in tensors]
    names = ", ".join(t.name for t in tensors)
    if len(set(dtypes)) > 1:
        given = ", ".join(f"{t.name}={pretty(t.dtype)}" for t in tensors)
        counts = {d: dtypes.count(d) for d in dtypes}
        majority = max(counts, key=lambda d: counts[d])
        odd = [t.name for t in tensors if t.dtype != majority]
        hint = (f" ({', '.join(odd)} differ{'s' if len(odd) == 1 else ''})"
                if counts[majority] > 1 else "")
        raise TypeError(
            f"{op}: {names} must share one dtype; got {given}{hint}. Nothing is cast "
            f"silently: cast them to one of {', '.join(allowed)} before the call (an fp32 "
            f"parameter, scale or norm mixed into one of them is the usual cause)")
    d = dtypes[0]
    if d not in allowed:
        extra = ""
        if d == "fp64":
            extra = "; float64 is accepted by impl='reference' and impl='chunked'"
        elif d in FLOAT_NAMES:
            extra = ""
        raise TypeError(
            f"{op}(impl={impl!r}): {names} have dtype {pretty(d)}; this implementation "
            f"supports {', '.join(pretty(a) for a in allowed)}{extra}")
    return d


def validate_op(op: str, impl: str, allowed: Sequence[str], q: TensorInfo, k: TensorInfo,
                v: TensorInfo, *, g: Optional[TensorInfo] = None, g_kind: str = "scalar",
                beta: Optional[TensorInfo] = None, g_gamma: Optional[TensorInfo] = None,
                initial_state: Optional[TensorInfo] = None,
                cu_seqlens: Optional[TensorInfo] = None,
                grouped_heads: bool = False) -> Dims:
    """Check every argument of a linear-attention op; return its sizes.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV == H, or HV % H == 0 when `grouped_heads`;
    g: [B, T, HV] (g_kind='scalar') or [B, T, HV, K] (g_kind='vector'); beta: [B, T, HV];
    g_gamma: [HV]; initial_state: [N, HV, K, V] float32 (float64 when q is float64);
    cu_seqlens: [N+1] integer, only with B == 1.
    """
    _check_rank(op, q, 4, "[B, T, H, K]")
    _check_rank(op, k, 4, "[B, T, H, K]")
    _check_rank(op, v, 4, "[B, T, HV, V]")
    dtype = _check_activation_dtypes(op, impl, allowed, [q, k, v])
    B, T, H, K = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"{op}: k has shape {_shape(k)}; expected the shape of q {_shape(q)} "
                         f"([B, T, H, K])")
    Bv, Tv, HV, V = v.shape
    if (Bv, Tv) != (B, T):
        raise ValueError(f"{op}: v has shape {_shape(v)}; expected batch and time of q "
                         f"[{B}, {T}, HV, V]")
    if grouped_heads:
        if HV % H != 0:
            raise ValueError(f"{op}: v has {HV} heads and q/k have {H}; expected HV % H == 0 "
                             f"(grouped value heads)")
    elif HV != H:
        raise ValueError(f"{op}: v has {HV} heads and q/k have {H}; expected the same number "
                         f"of heads (this op has no grouped value heads)")
    for name, size in (("K", K), ("V", V)):
        if size < 1:
            raise ValueError(f"{op}: head size {name}={size}; expected >= 1")
    if T < 1 or B < 1:
        raise ValueError(f"{op}: q has shape {_shape(q)}; expected B >= 1 and T >= 1")

    if g is not None:
        _check_float(op, g, "gates/log-decays")
        expected = (B, T, HV) if g_kind == "scalar" else (B, T, HV, K)
        layout = "[B, T, HV]" if g_kind == "scalar" else "[B, T, HV, K]"
        if tuple(g.shape) != expected:
            raise ValueError(f"{op}: {g.name} has shape {_shape(g)}; expected {layout} = "
                             f"[{', '.join(map(str, expected))}]")
    if beta is not None:
        _check_float(op, beta, "beta values")
        if tuple(beta.shape) != (B, T, HV):
            raise ValueError(f"{op}: beta has shape {_shape(beta)}; expected [B, T, HV] = "
                             f"[{B}, {T}, {HV}]")
    if g_gamma is not None:
        _check_float(op, g_gamma, "gates/log-decays")
        if tuple(g_gamma.shape) != (HV,):
            raise ValueError(f"{op}: g_gamma has shape {_shape(g_gamma)}; expected [H] = [{HV}]")

    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dtype not in INT_NAMES:
            raise TypeError(f"{op}: cu_seqlens has dtype {pretty(cu_seqlens.dtype)}; expected an "
                            f"integer dtype (int32 or int64)")
        if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"{op}: cu_seqlens has shape {_shape(cu_seqlens)}; expected [N+1] "
                             f"with N >= 1")
        if B != 1:
            raise ValueError(f"{op}: cu_seqlens given with batch size B={B}; expected B == 1 "
                             f"(pack the sequences along T)")
        N = cu_seqlens.shape[0] - 1

    if initial_state is not None:
        state_dtype = "fp64" if dtype == "fp64" else "fp32"
        if initial_state.dtype != state_dtype:
            raise TypeError(f"{op}: initial_state has dtype {pretty(initial_state.dtype)}; "
                            f"expected {pretty(state_dtype)} (recurrent states are float32)")
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"{op}: initial_state has shape {_shape(initial_state)}; expected "
                             f"[N, HV, K, V] = [{N}, {HV}, {K}, {V}] (N = "
                             f"{'len(cu_seqlens) - 1' if cu_seqlens is not None else 'B'})")
    return Dims(B, T, H, HV, K, V, N, dtype)


def check_cu_seqlens_values(op: str, values, T: int) -> None:
    """Value checks on a concrete cu_seqlens (a sequence of ints)."""
    vals = [int(x) for x in values]
    if vals[0] != 0:
        raise ValueError(f"{op}: cu_seqlens starts at {vals[0]}; expected it to start at 0")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(f"{op}: cu_seqlens decreases at index {i} ({vals[i - 1]} -> "
                             f"{vals[i]}); expected non-decreasing offsets")
    if vals[-1] != T:
        raise ValueError(f"{op}: cu_seqlens ends at {vals[-1]}; expected it to end at T={T} "
                         f"(the packed length of q)")


def check_head_dims(op: str, impl: str, K: int, V: int, max_size: int = 256) -> None:
    """Kernels take head sizes 1..max_size (non-powers of two are masked)."""
    for name, size in (("K", K), ("V", V)):
        if size > max_size:
            raise ValueError(f"{op}(impl={impl!r}): head size {name}={size}; this implementation "
                             f"supports {name} <= {max_size}; impl='chunked' has no limit")


def check_scale(op: str, scale) -> float:
    import numbers
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{op}: scale is {type(scale).__name__} {scale!r}; expected a Python "
                        f"float (or None for K ** -0.5)")
    import math
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale is {scale}; expected a finite float")
    return float(scale)
