"""FLA 0.6's input transforms (fla_contract/fla_inputs.py says which and why), in torch: beta
and the KDA gate derived from raw projections in float32 before the op, differentiable."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fla_contract.fla_inputs import check_transforms


def _work(x):
    """float32, or float64 for a float64 input (the reference paths)."""
    return torch.promote_types(x.dtype, torch.float32)


def _desc(x):
    return None if x is None else (tuple(x.shape), str(x.dtype).removeprefix("torch."))


def apply_transforms(op: str, g, beta, *, use_beta_sigmoid_in_kernel=False,
                     allow_neg_eigval=False, use_gate_in_kernel=False, A_log=None,
                     dt_bias=None, lower_bound=None):
    """(g, beta) for the op, float32 (float64 for float64 inputs): g [B, T, HV, K] from the
    raw gate projection when use_gate_in_kernel; beta [B, T, HV] = (2 if allow_neg_eigval
    else 1) sigmoid(beta) when use_beta_sigmoid_in_kernel; otherwise the inputs unchanged."""
    check_transforms(op, None if g is None else tuple(g.shape),
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                     allow_neg_eigval=allow_neg_eigval, use_gate_in_kernel=use_gate_in_kernel,
                     A_log=_desc(A_log), dt_bias=_desc(dt_bias), lower_bound=lower_bound)
    if use_beta_sigmoid_in_kernel and beta is not None:
        beta = torch.sigmoid(beta.to(_work(beta))) * (2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        HV, K, dt = g.shape[2], g.shape[3], _work(g)
        x = g.to(dt)
        if dt_bias is not None:
            x = x + dt_bias.to(dt).reshape(HV, K)
        if lower_bound is None:
            g = -A_log.to(dt).reshape(HV, 1).exp() * F.softplus(x)
        else:
            if A_log is not None:
                x = A_log.to(dt).reshape(HV, 1).exp() * x
            g = float(lower_bound) * torch.sigmoid(x)
    return g, beta
