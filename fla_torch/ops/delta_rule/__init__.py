from .interface import chunk_delta_rule, fused_recurrent_delta_rule

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule"]
