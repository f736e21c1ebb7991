"""One optimisation step for CausalLM with optax, written to match fla_torch.models.train
(torch.optim.AdamW) operation for operation, so both frameworks trained from the same weights
on the same batches give the same loss curve (fp32: agreement at rounding level).

The shared recipe: mean next-token cross-entropy in float32; gradient clipping by global norm
with torch's formula (scale = min(1, max_norm / (norm + 1e-6))); AdamW with decoupled weight
decay on parameters of rank >= 2 only; the learning rate of step i is lrs[i] (a precomputed
schedule, the same numbers in both frameworks; `lr_schedule` is the same function).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

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


def adamw(lrs, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          weight_decay: float = 0.1) -> optax.GradientTransformation:
    """optax.adamw whose step-i learning rate is lrs[i] (the last value after the end), with
    weight decay on parameters of rank >= 2 only (as fla_torch.models.train.adamw)."""
    table = jnp.asarray(lrs, jnp.float32)

    def schedule(count):
        return table[jnp.minimum(count, table.shape[0] - 1)]

    def mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)


def make_optimizer(model: nnx.Module, tx: optax.GradientTransformation) -> nnx.Optimizer:
    """nnx.Optimizer over the model's nnx.Param variables."""
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def clip_by_global_norm_torch(grads, max_norm: float):
    """Scale grads by min(1, max_norm / (global_norm + 1e-6)) (torch.nn.utils.clip_grad_norm_'s
    formula; optax.clip_by_global_norm omits the 1e-6)."""
    leaves = jax.tree.leaves(grads)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)


@nnx.jit(static_argnames=("clip_norm",))
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, inputs, targets,
               clip_norm: float | None = 1.0):
    """One step on a batch (inputs, targets [B, T] int): loss, grad, clip, AdamW (the learning
    rate comes from the optimizer's schedule). Updates model and optimizer in place; returns
    the loss before the update (a float32 scalar array)."""

    def loss_fn(m):
        return lm_loss(m(inputs), targets)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    if clip_norm is not None:
        grads = clip_by_global_norm_torch(grads, clip_norm)
    optimizer.update(model, grads)
    return loss
