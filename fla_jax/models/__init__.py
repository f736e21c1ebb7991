"""A tiny causal LM over fla_jax.layers (mirror of fla_torch.models)."""
from .config import ATTN_CLASSES, LMConfig
from .lm import Block, CausalLM, Embedding, GatedMLP, lm_loss

__all__ = ["ATTN_CLASSES", "LMConfig", "CausalLM", "Block", "Embedding", "GatedMLP", "lm_loss"]
