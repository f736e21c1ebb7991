from .interface import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, mosaic_unsupported_reason

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "mosaic_unsupported_reason"]
