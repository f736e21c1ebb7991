from .interface import chunk_gla, fused_recurrent_gla, mosaic_unsupported_reason

__all__ = ["chunk_gla", "fused_recurrent_gla", "mosaic_unsupported_reason"]
