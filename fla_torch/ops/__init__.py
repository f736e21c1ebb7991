"""Public ops, FLA's names and signatures, layout [B, T, H, D]."""
from .attention import attention
from .delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .gla import chunk_gla, fused_recurrent_gla
from .kda import chunk_kda, fused_recurrent_kda
from .rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7
from .simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

__all__ = [
    "attention",
    "chunk_simple_gla", "fused_recurrent_simple_gla", "chunk_gla", "fused_recurrent_gla",
    "chunk_delta_rule", "fused_recurrent_delta_rule", "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda", "chunk_rwkv7",
    "fused_recurrent_rwkv7",
]
