from .interface import chunk_rwkv7, fused_recurrent_rwkv7

__all__ = ["chunk_rwkv7", "fused_recurrent_rwkv7"]
