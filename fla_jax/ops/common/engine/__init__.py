"""The chunk engine (Pallas, Triton lowering): the stages every chunked linear-attention family
shares, with a gate switch (gates.GATE_NONE / GATE_SCALAR / GATE_KEY).

    state_pass.state_pass_fwd / state_pass_bwd   inter-chunk state pass (sequential over chunks)
    output_stage.output_fwd / output_bwd         output stage (chunk-parallel)
    cumsum_scores.cumsum_scores                  key gate: gate cumsum + scores A, qg, kg, el
    launch.Problem, launch.Launch, launch.launch_for   static problem, launch configuration
    varlen                                       the one varlen slot scheme (no host sync)
    gates                                        gate switch, split cumsums, accurate gaps
    pipeline.engine_chunk, pipeline.make_problem the stages in order as one custom_vjp
    delta_scores, wy, delta_prep, delta_state    the per-key-gated delta rule's stages
                                                 (chunk_kda, chained by kda/pallas_chunk.py;
                                                 its dq, dk, dg: output_grads with dAk, dkb)
    dplr, dplr_scores, dplr_state                the DPLR stage (chunk_rwkv7, chunk_kda_pallas_dplr)
  scalar gate / no gate, fused stages (a scalar decay costs one exp per row, so the state pass
  and the output stage run in one sequential kernel, nothing materialised between them):
    scan.scan_vjp, scan.scan_fwd / scan_bwd      the chunk scan (chunk_simple_gla)
    scalar_delta.delta_forward / delta_backward  the delta rule (chunk_gated_delta_rule,
                                                 chunk_delta_rule): scalar_wy_fwd,
                                                 scalar_delta_fwd, scalar_delta_bwd
    launch.delta_tiles                           their launch tiles
"""
from .gates import GATE_KEY, GATE_NONE, GATE_SCALAR
from .launch import Launch, Problem, launch_for
from .output_stage import output_bwd, output_fwd
from .state_pass import state_pass_bwd, state_pass_fwd
from .pipeline import engine_chunk, make_problem

__all__ = ["GATE_NONE", "GATE_SCALAR", "GATE_KEY", "Launch", "Problem", "launch_for",
           "state_pass_fwd", "state_pass_bwd", "output_fwd", "output_bwd", "engine_chunk",
           "make_problem"]
