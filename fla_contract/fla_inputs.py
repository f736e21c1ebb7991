"""FLA 0.6's input transforms, accepted by the same ops here so that FLA calls run unchanged.

FLA's chunk_kda / fused_recurrent_kda and chunk_gated_delta_rule /
fused_recurrent_gated_delta_rule can derive beta and (KDA) the per-key gate from raw
projections inside the op:
    use_beta_sigmoid_in_kernel:  beta = sigmoid(beta), times 2 with allow_neg_eigval
    use_gate_in_kernel (KDA):    g = -exp(A_log) * softplus(g + dt_bias)          (lower_bound None)
                                 g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
                                     (A_log None: lower_bound * sigmoid(g + dt_bias))
with A_log [HV] (one per value head) and dt_bias [HV * K] or [HV, K]. Here they are applied in
fp32 before the op (not fused into the kernels): the op then sees gates as it always does.
This file checks the arguments (framework-free); the frameworks' ops/common/fla_inputs.py
compute. FLA ignores allow_neg_eigval without use_beta_sigmoid_in_kernel, and A_log / dt_bias
without use_gate_in_kernel; here those calls raise, since nothing is silently dropped.
"""
from __future__ import annotations

import math

BETA_ARGS = ("use_beta_sigmoid_in_kernel", "allow_neg_eigval")
GATE_ARGS = ("use_gate_in_kernel", "A_log", "dt_bias", "lower_bound")
# op -> its transform arguments (keyword-only parameters of the public op, after impl)
TRANSFORMS = {
    "chunk_kda": GATE_ARGS + BETA_ARGS,
    "fused_recurrent_kda": GATE_ARGS + BETA_ARGS,
    "chunk_gated_delta_rule": BETA_ARGS,
    "fused_recurrent_gated_delta_rule": BETA_ARGS,
}


def check_transforms(op: str, g_shape: tuple | None, *, use_beta_sigmoid_in_kernel=False,
                     allow_neg_eigval=False, use_gate_in_kernel=False, A_log=None,
                     dt_bias=None, lower_bound=None) -> None:
    """Raise ValueError / TypeError naming the argument when the transform arguments of `op`
    are inconsistent. A_log / dt_bias: (shape tuple, dtype name) or None; g_shape: g's shape
    ([B, T, HV, K] for KDA)."""
    for name, flag in (("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval),
                       ("use_gate_in_kernel", use_gate_in_kernel)):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name}={flag!r}; expected True or False")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{op}: allow_neg_eigval=True without use_beta_sigmoid_in_kernel=True; "
                         f"it doubles sigmoid(beta) only (FLA ignores it otherwise): pass "
                         f"use_beta_sigmoid_in_kernel=True, or beta in (0, 2) directly")
    if not use_gate_in_kernel:
        given = [n for n, x in (("A_log", A_log), ("dt_bias", dt_bias),
                                ("lower_bound", lower_bound)) if x is not None]
        if given:
            raise ValueError(f"{op}: {', '.join(given)} given with use_gate_in_kernel=False; "
                             f"they only build the gate from g with use_gate_in_kernel=True")
        return
    if g_shape is None or len(g_shape) != 4:
        raise ValueError(f"{op}: use_gate_in_kernel=True needs g of shape [B, T, HV, K] (the raw "
                         f"gate projection); got {None if g_shape is None else list(g_shape)}")
    HV, K = g_shape[2], g_shape[3]
    if A_log is None and lower_bound is None:
        raise ValueError(f"{op}: use_gate_in_kernel=True needs A_log ([{HV}], one per value "
                         f"head) for g = -exp(A_log) softplus(g + dt_bias), or lower_bound for "
                         f"g = lower_bound sigmoid(g + dt_bias)")
    for name, x, shapes in (("A_log", A_log, ((HV,),)),
                            ("dt_bias", dt_bias, ((HV * K,), (HV, K)))):
        if x is None:
            continue
        shape, dtype = x
        if tuple(shape) not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise ValueError(f"{op}: {name} has shape {list(shape)}; expected {want} "
                             f"(HV={HV}, K={K} from g)")
        if not dtype.startswith(("float", "bfloat")):
            raise TypeError(f"{op}: {name} has dtype {dtype}; expected a float tensor "
                            f"(used in float32)")
    if lower_bound is not None:
        ok = isinstance(lower_bound, (int, float)) and not isinstance(lower_bound, bool)
        if not ok or not math.isfinite(lower_bound) or lower_bound >= 0:
            raise ValueError(f"{op}: lower_bound={lower_bound!r}; expected a finite negative "
                             f"number (the gate lies in (lower_bound, 0))")
