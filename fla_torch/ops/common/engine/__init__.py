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
