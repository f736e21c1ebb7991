from .interface import chunk_delta_rule, fused_recurrent_delta_rule, mosaic_unsupported_reason

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule", "mosaic_unsupported_reason"]
