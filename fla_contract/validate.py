"""One validation routine for every op, in both frameworks, driven by the op's OpSpec.

Each framework describes its arguments as `TensorInfo(name, shape, dtype)` (dtype as a
canonical name, see names.py, or the framework's own spelling for non-float types) and
calls `validate_op(spec, ...)`. Errors name the argument, what was given and what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

from .layout_hint import head_first_hint
from .names import FLOAT_NAMES, INT_NAMES, pretty
from .op_spec import ACTIVATION, GATE_DTYPE, STATE, STATE_DTYPE, ArgSpec, OpSpec


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple
    dtype: str


@dataclass(frozen=True)
class Dims:
    """Sizes of one call. N = number of sequences (len(cu_seqlens)-1, or B); `sizes` maps
    every dimension symbol of the op's OpSpec to its size."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    dtype: str
    sizes: Mapping = field(default_factory=dict)


_DIM_WORDS = {"B": "batch", "T": "time", "H": "heads", "HV": "value heads", "K": "key size",
              "V": "value size", "HKV": "key/value heads", "S": "key length"}


def _shape(t: TensorInfo) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _filled(a: ArgSpec, sizes: Mapping) -> str:
    return "[" + ", ".join(str(sizes.get(s, s)) for s in a.shape) + "]"


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
        extra = ("; float64 is accepted by impl='reference' and impl='chunked'" if d == "fp64"
                 else "")
        raise TypeError(
            f"{op}(impl={impl!r}): {names} have dtype {pretty(d)}; this implementation "
            f"supports {', '.join(pretty(a) for a in allowed)}{extra}")
    return d


def missing_arg_error(spec: OpSpec, name: str) -> TypeError:
    """The error for a required argument given as None."""
    a = spec.arg(name)
    return TypeError(f"{spec.name}: {name} is None; expected {name}, {a.what} (this op "
                     f"requires it)")


def _bind_activations(spec: OpSpec, given: Mapping[str, TensorInfo]) -> dict:
    """Sizes of the activations' symbols; k must have q's shape, v q's batch and time."""
    acts = spec.activations
    first, t0 = acts[0], given[acts[0].name]
    sizes = dict(zip(first.shape, t0.shape))
    owner = dict.fromkeys(first.shape, first.name)
    for a in acts[1:]:
        t = given[a.name]
        if a.shape == first.shape:
            if tuple(t.shape) != tuple(t0.shape):
                raise ValueError(f"{spec.name}: {a.name} has shape {_shape(t)}; expected the "
                                 f"shape of {first.name} {_shape(t0)} ({first.layout})")
            continue
        if any(s in sizes and sizes[s] != n for s, n in zip(a.shape, t.shape)):
            shared = [_DIM_WORDS.get(s, s) for s in a.shape if s in sizes]
            words = ", ".join(shared[:-1]) + " and " + shared[-1] if len(shared) > 1 else shared[0]
            by = owner[next(s for s, n in zip(a.shape, t.shape) if s in sizes and sizes[s] != n)]
            raise ValueError(f"{spec.name}: {a.name} has shape {_shape(t)}; expected {words} "
                             f"of {by} {_filled(a, sizes)}")
        owner.update((s, a.name) for s in a.shape if s not in sizes)
        sizes.update((s, n) for s, n in zip(a.shape, t.shape) if s not in sizes)
    return sizes


def _check_sizes(spec: OpSpec, given: Mapping[str, TensorInfo], sizes: dict) -> None:
    op = spec.name
    for sym, size in sizes.items():
        if sym not in ("B", "T") and size < 1:
            kind = "head size" if sym in ("K", "V") else "size"
            raise ValueError(f"{op}: {kind} {sym}={size}; expected >= 1")
    if sizes.get("T", 1) < 1 or sizes.get("B", 1) < 1:
        q = spec.activations[0]
        raise ValueError(f"{op}: {q.name} has shape {_shape(given[q.name])}; expected B >= 1 "
                         f"and T >= 1")
    if "H" in sizes and "HV" in sizes:
        H, HV = sizes["H"], sizes["HV"]
        if spec.grouped_heads:
            if HV % H != 0:
                raise ValueError(f"{op}: v has {HV} heads and q/k have {H}; expected HV % H == 0 "
                                 f"(grouped value heads)")
        elif HV != H:
            raise ValueError(f"{op}: v has {HV} heads and q/k have {H}; expected the same "
                             f"number of heads (this op has no grouped value heads)")
    if spec.grouped_query and sizes["HQ"] % sizes["HKV"] != 0:
        raise ValueError(f"{op}: q has {sizes['HQ']} heads and k/v have {sizes['HKV']}; "
                         f"expected HQ % HKV == 0 (grouped-query attention)")


def _check_arg(op: str, a: ArgSpec, t: TensorInfo, sizes: dict, dtype: str, why: str = "") -> None:
    """dtype and shape of one non-activation argument; binds symbols it introduces."""
    if a.dtype == GATE_DTYPE:
        _check_float(op, t, a.float_words)
    elif a.dtype == STATE_DTYPE:
        state_dtype = "fp64" if dtype == "fp64" else "fp32"
        if t.dtype != state_dtype:
            raise TypeError(f"{op}: {t.name} has dtype {pretty(t.dtype)}; expected "
                            f"{pretty(state_dtype)} (recurrent states are float32)")
    if len(t.shape) == len(a.shape):
        for s, n in zip(a.shape, t.shape):
            sizes.setdefault(s, n)
    expected = tuple(sizes.get(s) for s in a.shape)
    if tuple(t.shape) != expected:
        raise ValueError(f"{op}: {t.name} has shape {_shape(t)}; expected {a.layout} = "
                         f"{_filled(a, sizes)}{why}")


def _validate(spec: OpSpec, impl: str, allowed: Sequence[str], given: Mapping[str, TensorInfo],
              cu_seqlens: Optional[TensorInfo]) -> Dims:
    op = spec.name
    acts = spec.activations
    for a in acts:
        _check_rank(op, given[a.name], len(a.shape), a.layout)
    dtype = _check_activation_dtypes(op, impl, allowed, [given[a.name] for a in acts])
    sizes = _bind_activations(spec, given)
    _check_sizes(spec, given, sizes)
    for a in spec.args:
        if a.role not in (ACTIVATION, STATE) and given.get(a.name) is not None:
            _check_arg(op, a, given[a.name], sizes, dtype)

    sizes["N"] = sizes.get("B", 1)
    if cu_seqlens is not None:
        if cu_seqlens.dtype not in INT_NAMES:
            raise TypeError(f"{op}: cu_seqlens has dtype {pretty(cu_seqlens.dtype)}; expected an "
                            f"integer dtype (int32 or int64)")
        if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"{op}: cu_seqlens has shape {_shape(cu_seqlens)}; expected [N+1] "
                             f"with N >= 1")
        if sizes.get("B") != 1:
            raise ValueError(f"{op}: cu_seqlens given with batch size B={sizes.get('B')}; "
                             f"expected B == 1 (pack the sequences along T)")
        sizes["N"] = cu_seqlens.shape[0] - 1
        if sizes.get("S", sizes.get("T")) != sizes.get("T"):
            raise ValueError(f"{op}: cu_seqlens given with k of length S={sizes['S']} and q of "
                             f"length T={sizes['T']}; expected S == T (one packed sequence "
                             f"layout for q, k and v)")
    why = f" (N = {'len(cu_seqlens) - 1' if cu_seqlens is not None else 'B'})"
    for a in spec.of_role(STATE):
        if given.get(a.name) is not None:
            _check_arg(op, a, given[a.name], sizes, dtype, why if "N" in a.shape else "")
    s = sizes
    return Dims(s.get("B"), s.get("T"), s.get("H"), s.get("HV"), s.get("K"), s.get("V"), s["N"],
                dtype, MappingProxyType(dict(sizes)))   # read-only: validate_op reuses it


# Successful validations by call signature (spec, impl, allowed dtypes, every argument's name,
# shape and dtype, cu_seqlens' shape and dtype): a repeated call (a decode loop, a training
# step) skips the checks. A failing call is never stored, so its error is raised every time.
_VALIDATED: dict = {}
_VALIDATED_MAX = 4096


def validate_op(spec: OpSpec, impl: str, allowed: Sequence[str],
                tensors: Mapping[str, Optional[TensorInfo]],
                cu_seqlens: Optional[TensorInfo] = None) -> Dims:
    """Check every tensor argument of `spec` (tensors: public name -> TensorInfo or None);
    return the call's sizes (see `_validate_op`; the result of a signature already validated
    is reused)."""
    key = (id(spec), impl, tuple(allowed), tuple(tensors.items()), cu_seqlens)
    hit = _VALIDATED.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    dims = _validate_op(spec, impl, allowed, tensors, cu_seqlens)
    if len(_VALIDATED) >= _VALIDATED_MAX:
        _VALIDATED.clear()
    _VALIDATED[key] = (spec, dims)
    return dims


def _validate_op(spec: OpSpec, impl: str, allowed: Sequence[str],
                tensors: Mapping[str, Optional[TensorInfo]],
                cu_seqlens: Optional[TensorInfo] = None) -> Dims:
    """Check every tensor argument of `spec` (tensors: public name -> TensorInfo or None);
    return the call's sizes.

    Shapes and dtype rules come from the spec's ArgSpecs: activations (q, k, v) share one dtype
    in `allowed` with k of q's shape and v of q's batch and time; HV == H, or HV % H == 0 for
    grouped_heads; gates/beta/g_gamma any float dtype; states float32 (float64 when q is
    float64) of [N, HV, K, V]; cu_seqlens [N+1] integer, only with B == 1. A shape error that a
    head-first reading ([B, H, T, D]) of some tensors would explain says so.
    """
    unknown = set(tensors) - {a.name for a in spec.args}
    if unknown:
        raise TypeError(f"{spec.name}: unexpected argument(s) {', '.join(sorted(unknown))}")
    for a in spec.args:
        if a.required and tensors.get(a.name) is None:
            raise missing_arg_error(spec, a.name)
    given = {n: t for n, t in tensors.items() if t is not None}
    try:
        return _validate(spec, impl, allowed, given, cu_seqlens)
    except ValueError as e:
        def consistent(swapped):
            try:
                _validate(spec, impl, allowed, swapped, cu_seqlens)
                return True
            except (TypeError, ValueError):
                return False
        hint = head_first_hint(spec, given, consistent)
        if not hint:
            raise
        raise ValueError(f"{e}{hint}") from None


def state_parts(spec: OpSpec, initial_state) -> dict:
    """An op with OpSpec.state_tuple: its public initial_state (None, or a tuple/list with one
    entry per state part, each an array or None) -> {part name: entry}."""
    parts = spec.of_role(STATE)
    if initial_state is None:
        return dict.fromkeys(a.name for a in parts)
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != len(parts):
        given = (f"a {type(initial_state).__name__} of {len(initial_state)} entries"
                 if isinstance(initial_state, (tuple, list)) else
                 f"a {type(initial_state).__name__}")
        layouts = ", ".join(f"{a.name} {a.layout}" for a in parts)
        raise TypeError(f"{spec.name}: initial_state is {given}; expected None or a tuple "
                        f"({layouts}) of float32 states")
    return {a.name: t for a, t in zip(parts, initial_state)}


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


HEAD_SYMBOLS = ("K", "V", "M")   # head sizes a kernel tiles: key, value, GSA's slots


def check_head_dims(op: str, impl: str, sizes: Mapping, max_size: int = 256) -> None:
    """Kernels take head sizes 1..max_size (non-powers of two are masked); sizes: the call's
    Dims.sizes (every head-size symbol of the op's OpSpec that it binds is checked)."""
    for name in HEAD_SYMBOLS:
        size = sizes.get(name)
        if size is not None and size > max_size:
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
