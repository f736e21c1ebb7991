"""Steps shared by the serial (chunk after chunk) Mosaic GPU passes: a sequence's chunk range,
the carried state's start, the input stages' wait and prefetch, the double-buffered output
tile, the final state's store."""
from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .tiles import WGMMA, load, zeros_wgmma


def store_output(o_s, i, value, dst):
    """value (registers) -> dst (a GMEM ref view) through slot i % 2 of o_s [2, ...]: waits until
    the store that last read that slot (chunk i - 2) is done, then a TMA store."""
    slot = lax.rem(i, 2)
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    o_s.at[slot][...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s.at[slot], dst)


def issue_next_single_stage(i, count, issue):
    """With one input stage: the loads of chunk i + 1 (issue(i + 1, 0)) once chunk i is done."""
    @pl.when(i + 1 < count)
    def _():
        plgpu.commit_smem()
        issue(i + 1, 0)


def store_final_state(st_s, s_t, dst):
    """The carried state (fp32 registers) -> dst through st_s; waits for every store."""
    st_s[...] = s_t
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(st_s, dst)
    plgpu.wait_smem_to_gmem(0)


def sequence_range(tab_ref, n, tab_s, bar):
    """(first chunk, chunk count) of sequence n from its row of the int32 table (TMA)."""
    plgpu.copy_gmem_to_smem(tab_ref.at[n], tab_s, bar)
    plgpu.barrier_wait(bar)
    return tab_s[0], tab_s[1]


def carried_state(src, tile, bar, shape):
    """The carried fp32 state in registers (WGMMA layout): src (a GMEM ref view, through the
    SMEM tile `tile`) or zeros when src is None."""
    if src is None:
        return zeros_wgmma(shape)
    plgpu.copy_gmem_to_smem(src, tile, bar)
    plgpu.barrier_wait(bar)
    return load(tile, WGMMA)


def wait_and_prefetch(i, count, slot, stages, in_bar, issue):
    """Chunk i's inputs (stage `slot`) have landed; with two stages the loads of chunk i + 1
    go into the other one."""
    plgpu.barrier_wait(in_bar.at[slot])
    if stages > 1:
        @pl.when(i + 1 < count)
        def _():
            plgpu.commit_smem()
            issue(i + 1, 1 - slot)
