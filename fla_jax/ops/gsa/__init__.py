from .interface import chunk_gsa, fused_recurrent_gsa

__all__ = ["chunk_gsa", "fused_recurrent_gsa"]
