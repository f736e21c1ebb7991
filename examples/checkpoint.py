"""Save / load a CausalLM with its config and tokenizer as one .safetensors file (torch
parameter names; the same file loads into fla_torch and fla_jax). Metadata keys: 'config'
(LMConfig JSON), 'vocab' (tokenizer JSON), 'framework' (who wrote it). Each function imports
only the framework it needs."""
from __future__ import annotations

from pathlib import Path


def read_metadata(path):
    """(config dict, tokenizer, metadata) from a checkpoint written by save_*()."""
    import json

    from safetensors import safe_open

    from tiny_data import CharTokenizer
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; train one first: "
                                f"python examples/train_tiny_lm.py")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
    if "config" not in meta or "vocab" not in meta:
        raise ValueError(f"checkpoint {path}: metadata has keys {sorted(meta)}; expected "
                         f"'config' and 'vocab' (written by examples/checkpoint.py)")
    return json.loads(meta["config"]), CharTokenizer.from_json(meta["vocab"]), meta


def _metadata(config, tokenizer, framework: str) -> dict:
    return {"config": config.to_json(), "vocab": tokenizer.to_json(), "framework": framework}


def save_torch(model, tokenizer, path) -> None:
    from fla_torch.interop import save_safetensors
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(model, path, metadata=_metadata(model.config, tokenizer, "torch"))


def save_jax(model, tokenizer, path) -> None:
    from fla_jax.interop import save_safetensors
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(model, path, metadata=_metadata(model.config, tokenizer, "jax"))


def load_torch(path, device=None, policy: str | None = None):
    """(fla_torch CausalLM, tokenizer); policy overrides the saved config's policy."""
    from fla_torch.interop import load_safetensors
    from fla_torch.models import CausalLM, LMConfig
    cfg, tok, _ = read_metadata(path)
    if policy is not None:
        cfg["policy"] = policy
    model = CausalLM(LMConfig.from_dict(cfg))
    load_safetensors(model, path, strict=True)
    return (model.to(device) if device is not None else model), tok


def load_jax(path, policy: str | None = None, seed: int = 0):
    """(fla_jax CausalLM, tokenizer); policy overrides the saved config's policy."""
    from flax import nnx

    from fla_jax.interop import load_safetensors
    from fla_jax.models import CausalLM, LMConfig
    cfg, tok, _ = read_metadata(path)
    if policy is not None:
        cfg["policy"] = policy
    model = CausalLM(LMConfig.from_dict(cfg), rngs=nnx.Rngs(seed))
    load_safetensors(model, path, strict=True)
    return model, tok
