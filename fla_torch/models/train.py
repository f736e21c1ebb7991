"""One optimisation step for CausalLM with torch.optim.AdamW, written to match
fla_jax.models.train (optax) operation for operation, so both frameworks trained from the same
weights on the same batches give the same loss curve (fp32: agreement at rounding level).

The shared recipe: mean next-token cross-entropy in float32; gradient clipping by global norm
with torch's formula (scale = min(1, max_norm / (norm + 1e-6))); AdamW with decoupled weight
decay on parameters of rank >= 2 only; the learning rate of step i is lrs[i] (a precomputed
schedule, the same numbers in both frameworks).
"""
from __future__ import annotations

import math

import torch

from .lm import lm_loss


def lr_schedule(peak_lr: float, steps: int, warmup: int | None = None,
                final_ratio: float = 0.1) -> list:
    """Linear warmup to peak_lr over `warmup` steps (default 10% of steps, at least 1), then a
    cosine decay to final_ratio * peak_lr at the last step. Returns `steps` Python floats."""
    warmup = max(1, steps // 10) if warmup is None else max(1, warmup)
    lrs = []
    for i in range(steps):
        if i < warmup:
            lrs.append(peak_lr * (i + 1) / warmup)
        else:
            frac = (i - warmup) / max(1, steps - 1 - warmup)
            lrs.append(peak_lr * (final_ratio + (1 - final_ratio) * 0.5 *
                                  (1 + math.cos(math.pi * frac))))
    return lrs


def adamw(model: torch.nn.Module, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
          weight_decay: float = 0.1) -> torch.optim.AdamW:
    """torch.optim.AdamW with weight decay on parameters of rank >= 2 (matrices, embeddings,
    conv kernels) and none on vectors (norm weights, biases, A_log, dt_bias)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               inputs: torch.Tensor, targets: torch.Tensor, lr: float,
               clip_norm: float | None = 1.0) -> float:
    """One step on a batch (inputs, targets [B, T] int): loss, backward, clip, AdamW at `lr`.
    Returns the loss before the update as a Python float."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    return float(loss.detach())
