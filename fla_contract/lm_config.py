"""LMConfig: the tiny causal LM's configuration, written once (pure Python) for both frameworks:
one JSON dict builds the same model in fla_torch.models and fla_jax.models.

    cfg = LMConfig(vocab_size=96, hidden_size=64, num_layers=2, attn="gated_deltanet")
    cfg.to_dict() / LMConfig.from_dict(d)        # JSON-able, e.g. safetensors metadata
    cfg.layer_class(i), cfg.attn_kwargs_for(i)   # block i's layer class name and its arguments

Hybrid models (linear attention + softmax attention): `attn_layers` lists the blocks whose
layer is softmax `Attention`; the others use `attn`. A 4-layer Qwen3-Next-style 3:1 stack:

    LMConfig(num_layers=4, attn="gated_deltanet", attn_layers=[3])      # gdn, gdn, gdn, attn
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
    "gsa": "GatedSlotAttention",
    "kda": "KimiDeltaAttention",
    "rwkv7": "RWKV7Attention",
    "attention": "Attention",
}
SOFTMAX_ATTN = "Attention"


@dataclass
class LMConfig:
    """Configuration of `CausalLM` (same fields in fla_torch and fla_jax).

    vocab_size, hidden_size (D), num_layers: the usual.
    attn: 'linear_attention' | 'retention' | 'gla' | 'delta_net' | 'gated_deltanet' | 'kda' |
        'rwkv7' | 'gsa' | 'attention' (softmax attention in every block). 'rwkv7' needs
        num_heads * head_dim == hidden_size (RWKV-7's keys span the hidden size) and block 0 an
        RWKV-7 block (it makes the v_first that later blocks mix in); 'gsa'
        (GatedSlotAttention) needs num_heads * head_v_dim == hidden_size, its g_norm's size.
    attn_layers: indices of the blocks that are softmax `Attention` layers (a hybrid; the
        others use `attn`), e.g. [3] or [1, 3]; default none.
    softmax_attn_kwargs: extra constructor arguments for the Attention blocks (num_kv_heads,
        qk_norm, window_size, rope_theta, qkv_bias). Their head size is hidden_size //
        num_heads (FLA's Attention).
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
    attn_layers: list = field(default_factory=list)
    softmax_attn_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.attn not in ATTN_CLASSES:
            raise ValueError(f"LMConfig: attn={self.attn!r}; expected one of "
                             f"{', '.join(repr(a) for a in ATTN_CLASSES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LMConfig: {name}={value!r}; expected a positive int")
        layers = self.attn_layers
        if (not isinstance(layers, (list, tuple))
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
                or any(not 0 <= i < self.num_layers for i in layers)
                or len(set(layers)) != len(layers)):
            raise ValueError(f"LMConfig: attn_layers={layers!r}; expected a list of distinct "
                             f"block indices in [0, num_layers={self.num_layers})")
        self.attn_layers = sorted(layers)
        if self.hidden_size % self.num_heads and (self.attn_layers or self.attn == "attention"):
            raise ValueError(f"LMConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads} (the Attention blocks' head size)")
        if self.attn == "rwkv7":
            if self.num_heads * self.head_dim != self.hidden_size:
                raise ValueError(f"LMConfig: attn='rwkv7' with num_heads * head_dim = "
                                 f"{self.num_heads * self.head_dim}; expected hidden_size = "
                                 f"{self.hidden_size} (RWKV-7's key dimension is hidden_size)")
            if 0 in self.attn_layers:
                raise ValueError("LMConfig: attn='rwkv7' with block 0 in attn_layers; expected "
                                 "block 0 to be RWKV-7 (its layer_idx=0 layer makes v_first)")
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

    def layer_class(self, layer_idx: int) -> str:
        """The layer class name of block `layer_idx`: 'Attention' for attn_layers, else
        attn_class."""
        return SOFTMAX_ATTN if layer_idx in self.attn_layers else self.attn_class

    @property
    def layer_types(self) -> list:
        """Per block: 'attention' or the config's `attn`, e.g. ['gated_deltanet', 'attention']."""
        return ["attention" if i in self.attn_layers else self.attn
                for i in range(self.num_layers)]

    def attn_kwargs_for(self, layer_idx: int) -> dict:
        """Constructor arguments of the attention layer of block `layer_idx` (both frameworks;
        dtype/policy arguments are added by the model). GatedDeltaNet takes head_dim/expand_v
        directly (RWKV7Attention: head_dim and value_dim); the other layers size their heads from hidden_size * expand_k / num_heads,
        so expand_k and expand_v are derived from head_dim and head_v_dim."""
        H, K, V, D = self.num_heads, self.head_dim, self.head_v_dim, self.hidden_size
        if self.layer_class(layer_idx) == SOFTMAX_ATTN:
            kw = {"hidden_size": D, "num_heads": H, "layer_idx": layer_idx,
                  "norm_eps": self.norm_eps}
            kw.update(self.softmax_attn_kwargs)
            return kw
        kw = {"hidden_size": D, "num_heads": H, "mode": self.attn_mode,
              "layer_idx": layer_idx, "norm_eps": self.norm_eps}
        if self.attn in ("gated_deltanet", "kda"):
            kw.update(head_dim=K, expand_v=self.expand_v)
        elif self.attn == "rwkv7":
            del kw["num_heads"]
            kw.update(head_dim=K, value_dim=H * V, num_hidden_layers=self.num_layers)
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
