from .interface import chunk_gla, fused_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla"]
