"""The chunk engine (Triton): inter-chunk state pass and chunk-parallel output stage, forward
and backward, with a gate switch (none / scalar per head / per key channel).

Public functions (host side, torch tensors in [B, T, H, D] layout):
    state_pass_fwd, state_pass_bwd   (state_pass.py)
    output_fwd, output_bwd           (output_stage.py)
    launch_for, LaunchConfig         (launch.py)
    n_slots                          (varlen.py)
    gate_code, GATE_NONE, GATE_SCALAR, GATE_KEY (gates.py)
"""
from .gates import GATE_KEY, GATE_NONE, GATE_SCALAR, gate_code
from .launch import LaunchConfig, launch_for
from .output_stage import output_bwd, output_fwd
from .state_pass import state_pass_bwd, state_pass_fwd
from .varlen import n_slots

__all__ = ["GATE_KEY", "GATE_NONE", "GATE_SCALAR", "gate_code", "LaunchConfig", "launch_for",
           "output_bwd", "output_fwd", "state_pass_bwd", "state_pass_fwd", "n_slots"]
