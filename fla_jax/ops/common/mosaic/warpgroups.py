"""Steps shared by the warp-specialized Mosaic GPU kernels (a memory warpgroup streaming chunk
inputs into stages for compute warpgroups): the register split, the stage stream, the common
exit."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .tiles import interpreting


def registers(n: int, action: str):
    """plgpu.set_max_registers (no-op under gpu_interpret())."""
    if not interpreting():
        plgpu.set_max_registers(n, action=action)


def max_bound(a, b):
    """max of loop bounds that may be static ints or traced scalars."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return jnp.maximum(a, b)


def stream_stages(count, stages: int, in_free, issue):
    """The memory warpgroup's loop: issue(c, slot) loads chunk c into stage slot = c % stages;
    the first `stages` chunks at once, each later one once the compute warpgroups have released
    its stage (in_free[slot]); then it observes the releases of the last stages (every phase of
    in_free is waited once)."""
    for c in range(stages):
        @pl.when(c < count)
        def _fill():
            issue(c, c)

    def refill(c, carry):
        slot = lax.rem(c, stages)
        plgpu.barrier_wait(in_free.at[slot])
        issue(c, slot)
        return carry

    lax.fori_loop(stages, max_bound(count, stages), refill, None)
    observe_last(count, stages, in_free)


def observe_last(count, n: int, bars):
    """Wait for the last phases of a ring of n barriers used once per chunk (chunk c on
    bars[c % n]): those of chunks count - n .. count - 1, which no later use has waited for."""
    def observe(c, carry):
        plgpu.barrier_wait(bars.at[lax.rem(c, n)])
        return carry

    lax.fori_loop(max_bound(count - n, 0), count, observe, None)


def finish_together(done):
    """Every warpgroup arrives at `done` (num_arrivals = warpgroups) and waits for the others."""
    plgpu.barrier_arrive(done.at[0])
    plgpu.barrier_wait(done.at[0])
