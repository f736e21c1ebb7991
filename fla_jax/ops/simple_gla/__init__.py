from .interface import chunk_simple_gla, fused_recurrent_simple_gla, mosaic_unsupported_reason

__all__ = ["chunk_simple_gla", "fused_recurrent_simple_gla", "mosaic_unsupported_reason"]
