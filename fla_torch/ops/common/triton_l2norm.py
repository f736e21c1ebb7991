"""use_qk_l2norm_in_kernel for the Triton paths: y = x / sqrt(sum(x^2) + 1e-6) over the last
axis, computed in fp32 and returned in x's dtype, with a fused backward (one Triton pass each
way instead of several torch elementwise passes). x: [..., K] contiguous, K <= 256."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-6


@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, R):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (rows < R)[:, None] & (o_k < K)[None, :]
    p = rows.to(tl.int64)[:, None] * K + o_k[None, :]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)
    tl.store(y + p, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, b_r, mask=rows < R)


@triton.jit
def _l2norm_bwd_kernel(x, rstd, dy, dx, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                       R):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (rows < R)[:, None] & (o_k < K)[None, :]
    p = rows.to(tl.int64)[:, None] * K + o_k[None, :]
    b_r = tl.load(rstd + rows, mask=rows < R, other=0.0)
    b_y = tl.load(x + p, mask=m, other=0.0).to(tl.float32) * b_r[:, None]
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    b_dx = (b_dy - b_y * tl.sum(b_y * b_dy, axis=1)[:, None]) * b_r[:, None]
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


def _launch(K):
    BK = triton.next_power_of_2(K)
    return BK, max(1, 4096 // BK)


class L2Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        K = x.shape[-1]
        R = x.numel() // K
        BK, BR = _launch(K)
        y = torch.empty_like(x)
        rstd = torch.empty(R, dtype=torch.float32, device=x.device)
        _l2norm_fwd_kernel[(triton.cdiv(R, BR),)](x, y, rstd, K=K, BK=BK, BR=BR, R=R)
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        K = x.shape[-1]
        R = x.numel() // K
        BK, BR = _launch(K)
        dx = torch.empty_like(x)
        _l2norm_bwd_kernel[(triton.cdiv(R, BR),)](x, rstd, dy.contiguous(), dx, K=K, BK=BK,
                                                  BR=BR, R=R)
        return dx


def l2norm_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., K] in bf16/fp16/fp32 -> same shape and dtype, l2-normalised in fp32."""
    return L2Norm.apply(x)
