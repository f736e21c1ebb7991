"""LMConfig: the tiny causal LM's configuration, written once (pure Python) for both frameworks:
one JSON dict builds the same model in fla_torch.models and fla_jax.models.

    cfg = LMConfig(vocab_size=96, hidden_size=64, num_layers=2, attn="gated_deltanet")
    cfg.to_dict() / LMConfig.from_dict(d)        # JSON-able, e.g. safetensors metadata
    cfg.attn_class, cfg.attn_kwargs(layer_idx)   # the layer class name and its constructor args
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

# attn name -> layer class name in fla_torch.layers / fla_jax.layers
ATTN_CLASSES = {
    "linear_attention": "LinearAttention",
    "retention": "MultiScaleRetention",
    "gla": "GatedLinearAttention",
    "delta_net": "DeltaNet",
    "gated_deltanet": "GatedDeltaNet",
}


@dataclass
class LMConfig:
    """Configuration of `CausalLM` (same fields in fla_torch and fla_jax).

    vocab_size, hidden_size (D), num_layers: the usual.
    attn: 'linear_attention' | 'retention' | 'gla' | 'delta_net' | 'gated_deltanet'.
    num_heads, head_dim: q/k heads and their size K; value heads have V = head_dim * expand_v.
    mlp_ratio: the gated MLP's intermediate size is mlp_ratio * hidden_size, rounded up to a
        multiple of 8.
    norm_eps: eps of every RMSNorm. tie_embeddings: the output head is the embedding matrix.
    attn_mode: the layers' mode for full-sequence calls ('chunk' | 'fused_recurrent').
    attn_kwargs: extra constructor arguments for the attention layer (override the derived ones).
    initializer_range: std of the normal initialisation of the embeddings.
    policy: None (compute in the parameter dtype; torch: or the autocast dtype) or a policy
        string ('bf16', 'params=fp32,compute=bf16,output=fp32'): parameters stored in
        `params`, computed in `compute`, logits returned in `output`.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    attn: str = "gated_deltanet"
    num_heads: int = 2
    head_dim: int = 32
    expand_v: float = 1.0
    mlp_ratio: float = 8 / 3
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attn_mode: str = "chunk"
    attn_kwargs: dict = field(default_factory=dict)
    initializer_range: float = 0.02
    policy: str | None = None

    def __post_init__(self):
        if self.attn not in ATTN_CLASSES:
            raise ValueError(f"LMConfig: attn={self.attn!r}; expected one of "
                             f"{', '.join(repr(a) for a in ATTN_CLASSES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LMConfig: {name}={value!r}; expected a positive int")
        if self.mlp_ratio <= 0:
            raise ValueError(f"LMConfig: mlp_ratio={self.mlp_ratio}; expected > 0")
        v = self.head_dim * self.expand_v
        if abs(v - round(v)) > 1e-6 or round(v) < 1:
            raise ValueError(f"LMConfig: head_dim * expand_v = {v}; expected a positive integer "
                             f"value head size")

    @property
    def head_v_dim(self) -> int:
        return round(self.head_dim * self.expand_v)

    @property
    def intermediate_size(self) -> int:
        n = int(round(self.mlp_ratio * self.hidden_size))
        return -(-n // 8) * 8

    @property
    def attn_class(self) -> str:
        return ATTN_CLASSES[self.attn]

    def attn_kwargs_for(self, layer_idx: int) -> dict:
        """Constructor arguments of the attention layer of block `layer_idx` (both frameworks;
        dtype/policy arguments are added by the model). GatedDeltaNet takes head_dim/expand_v
        directly; the other layers size their heads from hidden_size * expand_k / num_heads,
        so expand_k and expand_v are derived from head_dim and head_v_dim."""
        H, K, V, D = self.num_heads, self.head_dim, self.head_v_dim, self.hidden_size
        kw = {"hidden_size": D, "num_heads": H, "mode": self.attn_mode,
              "layer_idx": layer_idx, "norm_eps": self.norm_eps}
        if self.attn == "gated_deltanet":
            kw.update(head_dim=K, expand_v=self.expand_v)
        else:
            kw.update(expand_k=H * K / D, expand_v=H * V / D)
        kw.update(self.attn_kwargs)
        return kw

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d) -> "LMConfig":
        if isinstance(d, str):
            d = json.loads(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"LMConfig.from_dict: unknown keys {unknown}; expected a subset of "
                             f"{sorted(known)}")
        return cls(**d)
