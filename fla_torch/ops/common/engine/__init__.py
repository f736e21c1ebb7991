"""The chunk engine (Triton): inter-chunk state pass and chunk-parallel output stage, forward
and backward, with a gate switch (none / scalar per head / per key channel).

Public functions (host side, torch tensors in [B, T, H, D] layout):
    chunk_cumsum                     (gates.py: the split in-chunk gate cumsum, once)
    state_pass_fwd, state_pass_bwd   (state_pass.py)
    intra_scores                     (scores.py: the intra-chunk scores A, once per chunk)
    output_fwd / output_bwd          (output_stage.py / output_grads.py)
    chunk_forward, chunk_backward    (pipeline.py: the stages in order)
    launch_for, LaunchConfig         (launch.py)
    n_slots                          (varlen.py)
    gate_code, GATE_NONE, GATE_SCALAR, GATE_KEY (gates.py)
Per-key-gated delta rule (chunk_kda): delta_scores, wy, delta_state, delta_bwd. DPLR (chunk_rwkv7):
dplr*.py. Scalar gate / no gate, fused stages (a scalar decay costs one exp per row, so the
state pass and the output stage run in one sequential kernel, nothing materialised between):
    scan_fwd, scan_bwd               (scan.py: the chunk scan, chunk_simple_gla)
    delta_forward, delta_backward    (scalar_delta.py: the delta rule, chunk_gated_delta_rule and
                                      chunk_delta_rule; kernels scalar_wy_fwd, scalar_delta_fwd,
                                      scalar_delta_bwd, scalar_wy_bwd, split_dot)
    scan_launch, delta_launch        (launch.py: their launch configurations)
"""
from .gates import GATE_KEY, GATE_NONE, GATE_SCALAR, chunk_cumsum, gate_code
from .launch import LaunchConfig, launch_for
from .output_grads import output_bwd
from .output_stage import output_fwd
from .pipeline import chunk_backward, chunk_forward
from .scores import intra_scores
from .state_pass import state_pass_bwd, state_pass_fwd
from .varlen import n_slots

__all__ = ["GATE_KEY", "GATE_NONE", "GATE_SCALAR", "gate_code", "chunk_cumsum", "intra_scores",
           "chunk_forward", "chunk_backward", "LaunchConfig", "launch_for", "output_bwd",
           "output_fwd", "state_pass_bwd", "state_pass_fwd", "n_slots"]
