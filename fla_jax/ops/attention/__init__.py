from .interface import attention

__all__ = ["attention"]
