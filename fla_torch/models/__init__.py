"""A tiny causal LM over fla_torch.layers (mirror of fla_jax.models)."""
from .config import ATTN_CLASSES, LMConfig
from .lm import Block, CausalLM, GatedMLP, lm_loss

__all__ = ["ATTN_CLASSES", "LMConfig", "CausalLM", "Block", "GatedMLP", "lm_loss"]
