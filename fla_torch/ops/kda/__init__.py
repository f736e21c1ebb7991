from .interface import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
