"""The LM configuration is framework-free and shared: see fla_contract/lm_config.py."""
from fla_contract.lm_config import ATTN_CLASSES, LMConfig

__all__ = ["ATTN_CLASSES", "LMConfig"]
