"""CausalLM: a tiny causal language model built from fla_torch.layers (mirror of
fla_jax.models.lm, with the same parameter names and arithmetic).

    embeddings -> num_layers x [x + attn(attn_norm(x)); x + mlp(mlp_norm(x))] -> norm -> head

State-dict names (identical in fla_jax, see fla_jax.interop):
    embeddings.weight [vocab, D]
    layers.{i}.attn_norm.weight [D], layers.{i}.attn.* (the attention layer's own names),
    layers.{i}.mlp_norm.weight [D], layers.{i}.mlp.{gate_proj,up_proj}.weight [I, D],
    layers.{i}.mlp.down_proj.weight [D, I], norm.weight [D],
    lm_head.weight [vocab, D] (only with tie_embeddings=False; tied: the head IS
    embeddings.weight and has no key of its own).

Dtypes: parameters are stored in the dtype they were built with (`dtype=`, or
`policy.params` when the config has a policy) or moved to with `.to()`. The compute dtype is
config.policy's `compute`, else the autocast dtype when autocast is on, else the embedding
weight's dtype. The residual stream is in the compute dtype; logits are returned in the
policy's `output` dtype (the compute dtype without a policy).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fla_contract.layer_inputs import check_input_ids, not_an_array

from .. import layers as fla_layers
from ..dtypes import DtypePolicy, dtype_name
from ..modules import RMSNorm
from ..modules.precision import compute_dtype, linear, no_autocast
from .config import LMConfig


class GatedMLP(nn.Module):
    """SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)).

    x [..., D] -> [..., D] in `dtype` (x's dtype by default); silu is computed in float32.
    Parameters: gate_proj, up_proj [I, D]; down_proj [D, I] (no biases)."""

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **f)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **f)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **f)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        cd = x.dtype if dtype is None else dtype
        gate = linear(x, self.gate_proj, cd)
        up = linear(x, self.up_proj, cd)
        with no_autocast(x):
            h = (F.silu(gate.float()) * up.float()).to(cd)
        return linear(h, self.down_proj, cd)


class Block(nn.Module):
    """x + attn(attn_norm(x)), then + mlp(mlp_norm(.)); x [B, T, D] in the compute dtype."""

    def __init__(self, config: LMConfig, layer_idx: int, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **f)
        self.attn = getattr(fla_layers, config.layer_class(layer_idx))(
            **config.attn_kwargs_for(layer_idx), **f)
        _check_attn_sizes(config, self.attn)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **f)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, **f)

    def forward(self, x: torch.Tensor, cache=None, use_cache: bool = False,
                max_cache_len=None, v_first=None):
        """-> (x, cache, v_first): v_first is RWKV-7's value of block 0, passed along."""
        cd = x.dtype
        kv = {} if max_cache_len is None or not _has_kv_cache(self.attn) else \
            {"max_cache_len": max_cache_len}
        if isinstance(self.attn, fla_layers.RWKV7Attention):
            kv["v_first"] = v_first
        out = self.attn(self.attn_norm(x), past_key_values=cache, use_cache=use_cache, **kv)
        o, cache = out[0], out[2]
        if len(out) == 4:
            v_first = out[3]
        x = x + o.to(cd)
        x = x + self.mlp(self.mlp_norm(x), cd)
        return x, cache, v_first


def _has_kv_cache(attn) -> bool:
    """The softmax Attention layer (a KV cache with a capacity); linear layers have none."""
    return isinstance(attn, fla_layers.Attention)


def _check_attn_sizes(config: LMConfig, attn) -> None:
    """The derived expand_k / expand_v must give exactly num_heads x head_dim (head_v_dim)."""
    want = (config.num_heads * config.head_dim, config.num_heads * config.head_v_dim)
    got = (getattr(attn, "key_dim", want[0]), getattr(attn, "value_dim", want[1]))
    if config.attn in ("gated_deltanet", "kda"):
        want = (want[0], getattr(attn, "num_v_heads", config.num_heads) * config.head_v_dim)
    if "expand_k" not in config.attn_kwargs and "expand_v" not in config.attn_kwargs \
            and tuple(got) != tuple(want):
        raise ValueError(f"LMConfig: {config.attn_class} built key/value dims {got} from "
                         f"hidden_size={config.hidden_size}; expected num_heads * head_dim = "
                         f"{want} (choose sizes whose ratio to hidden_size is exact)")


class CausalLM(nn.Module):
    """A tiny causal LM over fla_torch.layers.

    Args: config (LMConfig); device; dtype (parameter storage; default: the policy's params
        dtype, else torch's default dtype).
    forward(input_ids [B, T] int, cache=None, use_cache=False, max_cache_len=None):
        use_cache=False -> logits [B, T, vocab];
        use_cache=True  -> (logits, cache), cache = a list with one per-layer cache dict
        (fla_torch/layers/cache.py). Pass it back with the next tokens to continue: a prefill
        of T tokens and then one token at a time gives the logits of one full forward.
        max_cache_len: the capacity in tokens of the Attention layers' KV caches
        (layers/kv_cache.py) when this call creates the cache (prompt + new tokens; default:
        the prompt + 256, rounded up to a multiple of 256); the cache keeps its shapes from
        step to step. Linear-attention layers ignore it (their state has a fixed size).
    """

    def __init__(self, config: LMConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.policy = DtypePolicy.parse(config.policy) if config.policy is not None else None
        if dtype is None and self.policy is not None:
            dtype = self.policy.param_dtype
        f = {"device": device, "dtype": dtype}
        D = config.hidden_size
        self.embeddings = nn.Embedding(config.vocab_size, D, **f)
        self.layers = nn.ModuleList(Block(config, i, **f) for i in range(config.num_layers))
        self.norm = RMSNorm(D, eps=config.norm_eps, **f)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(D, config.vocab_size, bias=False, **f)
        with torch.no_grad():
            self.embeddings.weight.normal_(0.0, config.initializer_range)

    def compute_dtype(self) -> torch.dtype:
        """policy.compute, else the autocast dtype, else the embedding weight's dtype."""
        return compute_dtype(self.embeddings.weight, self.policy)

    def head_weight(self) -> torch.Tensor:
        return self.embeddings.weight if self.config.tie_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, cache=None, use_cache: bool = False,
                max_cache_len=None):
        if not isinstance(input_ids, torch.Tensor):
            raise not_an_array("CausalLM", "input_ids", type(input_ids).__name__,
                               "a torch.Tensor [B, T] of int64 or int32 token ids")
        # The id range is checked where it costs no device sync (CPU tensors); on a GPU the
        # embedding's own bounds check stops an out-of-range id.
        known = (input_ids.dtype in (torch.int32, torch.int64) and input_ids.numel() > 0
                 and input_ids.device.type == "cpu" and not torch.compiler.is_compiling())
        check_input_ids("CausalLM", tuple(input_ids.shape), dtype_name(input_ids.dtype),
                        self.config.vocab_size, int(input_ids.min()) if known else None,
                        int(input_ids.max()) if known else None, allowed=("int32", "int64"))
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"CausalLM: cache has {len(cache)} entries; expected one per layer "
                             f"({len(self.layers)})")
        cd = self.compute_dtype()
        x = self.embeddings(input_ids).to(cd)
        new_cache, v_first = [], None
        for i, block in enumerate(self.layers):
            x, c, v_first = block(x, None if cache is None else cache[i], use_cache,
                                  max_cache_len, v_first)
            new_cache.append(c)
        x = self.norm(x)
        with no_autocast(x):
            logits = F.linear(x, self.head_weight().to(cd))
        if self.policy is not None:
            logits = logits.to(self.policy.output_dtype)
        return (logits, new_cache) if use_cache else logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in float32: logits [B, T, vocab], targets [B, T] int."""
    with no_autocast(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
